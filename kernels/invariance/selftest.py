"""Startup self-test: prove, bitwise, on the loaded model and the running backend, that a
block of M <= L tokens gives each row the logits (and KV) of feeding the tokens one at a time.

A model with per-request state (a recurrent, conv or sliding-window cache) is proven another
way, since such a layer's block of rows is not its one-row calls: in ragged passes
(kernels/batching/ragged_selftest.py `per_request_self_test`).

No tolerance: logits are compared as raw bit patterns. A failure names the prefix length,
block width and row that differed, and by how much; the caller must then not claim the
guarantee.

With a `ProofCache` the result is kept per machine and re-used on a restart: its key is
the model's identity (weights digest and load-time transform, from the caller), the
installed strategy, L, widths, prefixes and seed, and `verdict_cache.environment()` (MLX
version, backend, device, CPU BLAS) plus the source of every kernels/ module and kernel
source (.c, .cu, .cuh, .metal), so a proof is only ever re-used for the same model, code,
MLX and device that produced it.
"""
import copy
import dataclasses
import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from ..proof_steps import step_done
from .cache_check import cache_invariance_problem, cache_refusal, is_per_request

log = logging.getLogger(__name__)

# unsigned integer dtype of each float width, to compare or hash raw bits
UINT_OF_SIZE = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


@dataclass(frozen=True)
class Mismatch:
    prefix: int  # tokens in the cache before the block
    width: int  # block width M
    row: int  # row within the block (-1: the KV rows of the whole block)
    what: str  # "logits", "keys" or "values" (layer given for KV)
    max_abs_diff: float

    def __str__(self):
        row = f", row {self.row}" if self.row >= 0 else ""
        return (f"{self.what} differ at prefix {self.prefix}, width {self.width}{row}"
                f" (max |diff| {self.max_abs_diff:.3g})")


@dataclass(frozen=True)
class SelfTestResult:
    passed: bool
    backend: str
    call_rows: int  # L: the most rows one kernel call may hold, each row its one-row bits
    widths: tuple
    prefixes: tuple
    mismatches: tuple = field(default=())
    reason: str = ""
    seconds: float = 0.0
    cached: bool = False  # re-used from the proof cache (made on this MLX + device earlier)

    def __bool__(self):
        return self.passed


@dataclass(frozen=True)
class ProofCache:
    """Where self-test results are kept (`verdict_cache.VerdictCache`), and the identity of
    the model they are about (JSON-able: e.g. weights digest and load-time transform).
    fresh: prove again and overwrite instead of re-using."""
    store: object
    model_identity: dict
    fresh: bool = False


def bits_equal(a: mx.array, b: mx.array) -> bool:
    """Bitwise equality (tells -0.0 from 0.0, equal NaN payloads match)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    u = UINT_OF_SIZE[a.dtype.size]
    return bool(mx.array_equal(a.view(u), b.view(u)))


def sample_widths(call_rows: int, most: int = 6) -> tuple:
    """Block widths to test: all of 2..L when few, else 2, L, 8 (where CUDA's quantized
    matmul leaves its per-row kernel) and evenly spaced ones between."""
    if call_rows < 2:
        return ()
    if call_rows - 1 <= most:
        return tuple(range(2, call_rows + 1))
    picks = {2, call_rows} | ({8} if call_rows >= 8 else set())
    step = (call_rows - 2) / (most - 1)
    picks |= {round(2 + i * step) for i in range(most)}
    return tuple(sorted(picks))


def _vocab_size(model) -> int:
    args = getattr(model, "args", None)
    if args is not None and getattr(args, "vocab_size", None):
        return int(args.vocab_size)
    return int(model.model.embed_tokens.weight.shape[0])


def _rewind(cache, n: int) -> None:
    for c in cache:
        c.trim(n)


def _kv_rows(cache, start: int, n: int):
    return [(c.keys[..., start : start + n, :], c.values[..., start : start + n, :]) for c in cache]


def new_state(cache: list, before: int) -> list[list[mx.array]]:
    """What a pass wrote into a request's caches, per layer: the KV rows from position `before`
    on for a positional (or pooled) cache, every array of the state for per-request state (a
    recurrent/conv state or a sliding window rewrites it in place). The rows are copies: a
    slice would keep its whole buffer alive (a KV pool's layer, each version a proof wrote)."""
    out = []
    for c in cache:
        if is_per_request(c):
            out.append([a for _, a in tree_flatten(c.state) if isinstance(a, mx.array)])
        else:
            out.append([mx.array(c.keys[..., before:c.offset, :]), mx.array(c.values[..., before:c.offset, :])])
    return out


def max_diff(a, b) -> float:
    return float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item())


# What kernels_code_version hashes: the Python modules and the kernel sources they load or
# build (the CPU BLAS shim's C, the custom kernels' CUDA and Metal), whose edits change bits.
CODE_PATTERNS = ("*.py", "*.c", "*.cu", "*.cuh", "*.metal")


def kernels_code_version() -> str:
    """Digest of every kernels/ module's source and kernel source file (the whole package,
    subpackages included): the canonical forms, the kernels they run and this proof."""
    root = Path(__file__).parents[1]  # kernels/, this file being kernels/invariance/selftest.py
    digest = hashlib.sha256()
    for path in sorted({p for pattern in CODE_PATTERNS for p in root.rglob(pattern)}):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def proof_key(model, call_rows: int, widths, prefixes, seed: int, stop_at_first: bool,
              model_identity: dict) -> dict:
    from lockstep.kernels.verdict_cache import environment, function_identity

    setting = getattr(model, "_lockstep_setting", None)
    strategy = dataclasses.asdict(setting.strategy) if setting is not None else None
    return {
        "what": "batch invariance self-test",
        "model": model_identity,
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "strategy": strategy,
        "expert_call_rows": setting.expert_call_rows if setting is not None else 0,
        "limit": call_rows,  # the key stored proofs were filed under
        "widths": list(widths),
        "prefixes": list(prefixes),
        "seed": seed,
        "stop_at_first": stop_at_first,
        "environment": environment(),
        "code": kernels_code_version(),
        # the ops the model's rows go through: a test double wrapping one is a new key
        "ops": [function_identity(f) for f in (mx.matmul, mx.addmm, mx.array.__matmul__,
                                               mx.quantized_matmul,
                                               mx.fast.scaled_dot_product_attention,
                                               mx.gather_mm, mx.gather_qmm)],
    }


def _result_to_json(r: SelfTestResult) -> dict:
    return {"passed": r.passed, "reason": r.reason, "seconds": r.seconds,
            "mismatches": [dataclasses.asdict(m) for m in r.mismatches]}


def _cached_result(value: dict, backend: str, call_rows: int, widths, prefixes) -> SelfTestResult:
    mismatches = tuple(Mismatch(**m) for m in value["mismatches"])
    passed = value["passed"]
    if not isinstance(passed, bool) or (passed and mismatches):
        raise ValueError("a passing result with mismatches")
    return SelfTestResult(passed, backend, call_rows, tuple(widths), tuple(prefixes), mismatches,
                          str(value["reason"]), 0.0, cached=True)


def default_prefixes() -> tuple:
    """Prefix lengths the proof runs at. On a GPU also 250: the block then crosses the KV
    cache's 256-slot step, where MLX's CUDA attention gave a strided cache view other bits
    than a packed copy (docs/DETERMINISM.md, skinny kernels). The CPU's native kernels take
    no such path, and a 250-token prefill there is slow."""
    return (11, 70) if mx.default_device() == mx.cpu else (11, 70, 250)


def self_test(model, call_rows: int, *, prefixes=None, widths=None, seed: int = 0,
              stop_at_first: bool = True, proof_cache: ProofCache | None = None) -> SelfTestResult:
    """Feed fresh random tokens after a random prefix of each length in `prefixes`; for each
    width M in `widths` (default: sample_widths(L)) compare a block of M tokens against the
    same M tokens fed one at a time from the same cache state (rewound between).
    proof_cache: re-use a result proven earlier on this machine, store a new one there."""
    return proven(_self_test, None, model, call_rows, prefixes, widths, seed, stop_at_first, proof_cache)


def proven(run, form, model, call_rows, prefixes, widths, seed, stop_at_first, proof_cache) -> SelfTestResult:
    widths = tuple(widths) if widths is not None else sample_widths(call_rows)
    prefixes = tuple(prefixes) if prefixes is not None else default_prefixes()
    if proof_cache is None or not widths:
        return run(model, call_rows, prefixes, widths, seed, stop_at_first)
    key = proof_key(model, call_rows, widths, prefixes, seed, stop_at_first,
                    proof_cache.model_identity)
    if form is not None:
        key["form"] = form
    value = None if proof_cache.fresh else proof_cache.store.get(key)
    if value is not None:
        try:
            return _cached_result(value, str(mx.default_device()), call_rows, widths, prefixes)
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("ignoring malformed cached self-test result: %s", exc)
    result = run(model, call_rows, prefixes, widths, seed, stop_at_first)
    proof_cache.store.put(key, _result_to_json(result))
    return result


def result_maker(call_rows: int, widths: tuple, prefixes):
    """A function of (mismatches, reason) giving the SelfTestResult of a proof started now."""
    t0 = time.perf_counter()
    backend = str(mx.default_device())

    def result(mismatches=(), reason=""):
        passed = not mismatches and not reason
        return SelfTestResult(passed, backend, call_rows, widths, tuple(prefixes), tuple(mismatches),
                              reason or ("; ".join(map(str, mismatches[:3])) if mismatches else "ok"),
                              time.perf_counter() - t0)

    return result


def _self_test(model, call_rows: int, prefixes, widths: tuple, seed: int,
               stop_at_first: bool) -> SelfTestResult:
    result = result_maker(call_rows, widths, prefixes)

    if not widths:
        return result(reason=f"nothing to prove for L={call_rows}")
    vocab = _vocab_size(model)
    key = mx.random.key(seed)
    mismatches = []
    for prefix in prefixes:
        key, k1, k2 = mx.random.split(key, 3)
        prompt = mx.random.randint(0, vocab, (1, prefix), key=k1)
        block = mx.random.randint(0, vocab, (1, max(widths)), key=k2)
        cache = make_prompt_cache(model)
        problem = cache_invariance_problem(cache)
        if problem:
            return result(reason=f"cache: {problem}")
        mx.eval(model(prompt, cache=cache))

        singles = []
        for i in range(max(widths)):
            out = model(block[:, i : i + 1], cache=cache)
            mx.eval(out)
            singles.append(out[0, 0])
        single_kv = _kv_rows(cache, prefix, max(widths))
        mx.eval(single_kv)
        _rewind(cache, max(widths))

        for w in widths:
            out = model(block[:, :w], cache=cache)
            mx.eval(out)
            for row in range(w):
                if not bits_equal(out[0, row], singles[row]):
                    mismatches.append(Mismatch(prefix, w, row, "logits", max_diff(out[0, row], singles[row])))
            for layer, ((k, v), (sk, sv)) in enumerate(zip(_kv_rows(cache, prefix, w), single_kv)):
                for name, got, want in (("keys", k, sk[..., :w, :]), ("values", v, sv[..., :w, :])):
                    if not bits_equal(got, want):
                        mismatches.append(Mismatch(prefix, w, -1, f"layer {layer} {name}", max_diff(got, want)))
            _rewind(cache, w)
            if mismatches and stop_at_first:
                return result(mismatches)
            step_done()
    return result(mismatches)


def seconds_per_step(model, width: int, *, prefix: int = 11, repeats: int = 3, seed: int = 1) -> float:
    """Best-of-`repeats` wall time of one forward pass of `width` tokens after `prefix`."""
    vocab = _vocab_size(model)
    k1, k2 = mx.random.split(mx.random.key(seed))
    cache = make_prompt_cache(model)
    mx.eval(model(mx.random.randint(0, vocab, (1, prefix), key=k1), cache=cache))
    tokens = mx.random.randint(0, vocab, (1, width), key=k2)
    mx.eval(tokens)
    best = float("inf")
    for _ in range(repeats):
        trial = copy.deepcopy(cache)  # per-request state cannot be rewound: each run a copy
        mx.eval([c.state for c in trial])
        t = time.perf_counter()
        mx.eval(model(tokens, cache=trial))
        best = min(best, time.perf_counter() - t)
    return best
