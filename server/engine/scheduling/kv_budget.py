"""The KV memory budget: requests are admitted only while their KV cache fits.

Each admitted request reserves the most KV it can ever hold (prompt + max_tokens + the
widest speculative pass + one allocation step of mlx-lm's KVCache), so running requests
never outgrow memory; the rest wait in the queue (and the API answers 429 when the queue
is full). The default budget is half of what MLX may still allocate after the weights,
in tokens of this model's KV; what MLX may allocate is the device's, or `serve --memory-limit`'s
(`hold_device_memory`).
"""
from __future__ import annotations

import threading

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

DEFAULT_MEMORY_FRACTION = 0.5


def kv_bytes_per_token(model) -> int:
    """Bytes of KV one token takes in this model's cache (measured with a one-token pass)."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    total = 0
    for layer in cache:
        for part in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if part is not None:
                total += part.shape[1] * part.shape[3] * part.dtype.size
    return max(1, total)


def hold_device_memory(limit_bytes: int) -> None:
    """Hold this process to `limit_bytes` of device memory (`serve --memory-limit`, before the
    model loads): MLX's memory limit and its buffer cache's. MLX sizes both from the whole device
    (CUDA: 80 % of the card each), so servers sharing a card would each plan for all of it; the
    default KV budget is then half of what the limit leaves after the model."""
    mx.set_memory_limit(limit_bytes)
    mx.set_cache_limit(limit_bytes)


def check_memory_left(limit_bytes: int | None) -> None:
    """ValueError where the model alone took what `--memory-limit` gives: no room for any KV."""
    active = mx.get_active_memory()
    if limit_bytes is not None and active >= limit_bytes:
        gb = 1 << 30
        raise ValueError(f"--memory-limit {limit_bytes / gb:.2f} GB leaves nothing for the KV cache: the model "
                         f"takes {active / gb:.2f} GB; give more")


def default_kv_tokens(model) -> int:
    free = max(0, mx.get_memory_limit() - mx.get_active_memory())
    return max(1, int(DEFAULT_MEMORY_FRACTION * free) // kv_bytes_per_token(model))


def device_memory() -> str | None:
    """MLX's device memory now, for the startup log (None on the CPU, where MLX counts none):
    what is in use, its buffer cache, the peak so far and the limit, so a log shows which
    startup step took the device's memory."""
    if mx.default_device().type != mx.gpu:
        return None
    gb = 1 << 30
    return (f"active {mx.get_active_memory() / gb:.1f} GB, cache {mx.get_cache_memory() / gb:.1f} GB, "
            f"peak {mx.get_peak_memory() / gb:.1f} GB of a {mx.get_memory_limit() / gb:.1f} GB limit")


def reservation(prompt_tokens: int, max_tokens: int, draft_tokens: int) -> int:
    """KV tokens a request may ever hold (its buffers grow in steps of KVCache.step)."""
    return prompt_tokens + max_tokens + draft_tokens + KVCache.step


class KVBudget:
    """A count of KV tokens; `None` capacity = unbounded."""

    def __init__(self, capacity: int | None):
        self.capacity = capacity
        self.reserved = 0
        self._lock = threading.Lock()

    def fits_at_all(self, tokens: int) -> bool:
        return self.capacity is None or tokens <= self.capacity

    def try_reserve(self, tokens: int) -> bool:
        with self._lock:
            if self.capacity is not None and self.reserved + tokens > self.capacity:
                return False
            self.reserved += tokens
            return True

    def release(self, tokens: int) -> None:
        with self._lock:
            self.reserved -= tokens
