"""One request run the way the engine runs it, for measurements outside the engine.

    path = EnginePath(model, deployment.kv_pool)
    cache = path.new_cache(tokens)          # a KV pool range, or plain KVCaches
    logits = path.step(model, cache, rows)  # a ragged pass of this one request
    path.release(cache)

The engine decodes every request in ragged passes over caches from its KV pool (when the
deployment has one), so a verification pass costs there what it costs here: the pass costs
adaptive speculation weighs k against, and `lockstep bench --tasks`, measure this path.
"""
from __future__ import annotations

from mlx_lm.models.cache import make_prompt_cache

POOL_TOKENS = 4096


class EnginePath:
    def __init__(self, model, kv_pool: str = "off"):
        from lockstep.kernels.batching.ragged import enable_ragged, ragged_problem

        self.model = model
        self.ragged = ragged_problem(model) is None
        if self.ragged:
            enable_ragged(model)
        self.pool = None
        if kv_pool != "off" and self.ragged:
            from lockstep.kernels.batching.kv_pool import KVPool

            self.pool = KVPool(model, POOL_TOKENS, use_kernel=kv_pool == "kernel")

    def new_cache(self, tokens: int) -> list:
        return make_prompt_cache(self.model) if self.pool is None else self.pool.allocate(tokens)

    def release(self, cache: list) -> None:
        if self.pool is not None:
            self.pool.release(cache)

    def step(self, model, cache: list, rows: list[int]):
        """Logits (len(rows), vocab) of one pass, as the engine runs it."""
        if not self.ragged:
            from lockstep.server.engine.request_state import forward

            return forward(model, cache, rows)
        from lockstep.kernels.batching.ragged import ragged_forward

        return ragged_forward(model, [(cache, rows)])[0]
