"""Bitwise proof that a ragged pass (kernels/batching/ragged.py) gives each request's rows the logits
and KV they get when that request's rows run alone, for every total width 1..W (W: the widest
pass the engine builds with deterministic rows, at least L; calls of more than L rows run in
blocks of at most L, kernels/invariance/layers.py `calls_in_blocks`, as the engine's decode
passes run them).

A pool of requests with different cached prefix lengths (one decode row each, plus a few
with several rows, as speculative verification brings) is run alone once each; then for
every width w a mix of pool members totalling w rows runs as one pass and each member's
logits and new KV rows (for recurrent, conv or sliding-window state: its whole state) are
compared as raw bits with its solo pass. Costs the pool's solo passes plus one pass per width.
A multi-row member is compared with the same rows alone, so the proof holds for models with
per-request state too (their layers run per request either way).

`compiled`: the passes of every width run as the engine's compiled canonical passes
(kernels/batching/compiled_pass.py) over the pool's kernel, each row still compared with its
solo pass built op by op (as a request alone, the solo paths and prompt chunks run).

`prove_ragged_cached` keeps every width as soon as it is proven (a partial record under the
finished proof's key, which a finished proof then replaces), so a start stopped mid-proof
leaves its proven widths to the next start: that one puts them in force at once and proves only
the wider ones, setting up (prefills, solo passes, caches) only the members those use; with
every width kept, nothing. A failed proof's record keeps the widths proven before the failure:
the fallback to passes of those widths (at least L; `credit_from`) proves only those it lacks. A record that
is not one of these shapes is ignored with a warning.
"""
from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, replace
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..proof_steps import step_done
from ..invariance.cache_check import cache_refusal
from ..invariance.selftest import (UINT_OF_SIZE, Mismatch, ProofCache, SelfTestResult, bits_equal, max_diff,
                                   new_state, proven, result_maker)
from .ragged import enable_ragged, per_request, ragged_forward, ragged_problem

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RaggedProof:
    passed: bool
    call_rows: int  # L: the most rows one kernel call may hold, each row its one-row bits
    widths: tuple
    reason: str = ""
    seconds: float = 0.0
    cached: bool = False  # re-used from the proof cache
    resumed: int = 0  # widths 1..resumed were kept from an interrupted or a wider proof, not proven again
    proven_widths: int = 0  # a failed proof: passes of 1..proven_widths rows passed before it failed

    def __bool__(self):
        return self.passed


def _bits(x: mx.array) -> mx.array:
    return x.view(UINT_OF_SIZE[x.dtype.size])


def _same(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(_bits(a), _bits(b)))


def _pool(call_rows: int, widest: int) -> list[tuple[int, int]]:
    """(prefix length, rows) per member: `widest` one-row decoders, and multi-row members of
    at most `call_rows` rows (a request's own rows: speculative verification)."""
    singles = [(3 + 2 * i, 1) for i in range(widest)]
    multi = [(5 + i, r) for i, r in enumerate(sorted({min(call_rows, 2), min(call_rows, 4)})) if r > 1]
    return singles + multi


def _members_for(width: int, pool: list[tuple[int, int]]) -> list[int]:
    """Indices of pool members whose rows total `width`: the widest multi-row member that
    leaves room for at least one other request (so it meets others), then one-row ones."""
    chosen, left = [], width
    multi = sorted((rows, i) for i, (_, rows) in enumerate(pool) if rows > 1)
    fitting = [(rows, i) for rows, i in multi if rows < width]
    if fitting:
        rows, i = fitting[-1]
        chosen.append(i)
        left -= rows
    chosen += [i for i, (_, rows) in enumerate(pool) if rows == 1][:left]
    return chosen


class _Caches:
    """Fresh caches and private copies: each request its own KVCaches, or ranges of one KV
    pool (kernels/batching/kv_pool.py) as the engine gives them with `kv_pool` "kernel"/"reference".
    `held`: how many caches are held at once at most (the pool is made that size: a proof's
    copies are released once compared, so it never grows by doubling while it runs)."""

    def __init__(self, model, kv_pool: str, tokens: int, held: int = 4):
        self.model = model
        self.pool = None
        if kv_pool != "off":
            from .kv_pool import KVPool

            self.pool = KVPool(model, held * tokens, use_kernel=kv_pool == "kernel")
        self.tokens = tokens

    def new(self) -> list:
        return make_prompt_cache(self.model) if self.pool is None else self.pool.allocate(self.tokens)

    def copy(self, cache: list) -> list:
        return copy.deepcopy(cache) if self.pool is None else self.pool.clone(cache)

    def release(self, caches: list) -> None:
        """Give copies back to the pool (their arrays read before stay valid)."""
        if self.pool is not None:
            for cache in caches:
                self.pool.release(cache)


def prove_ragged(model, call_rows: int, *, seed: int = 0, vocab: int | None = None,
                 kv_pool: str = "off", pass_rows: int | None = None, compiled: bool = False,
                 on_width: Callable[[int], None] | None = None, proven: int = 0) -> RaggedProof:
    """Prove ragged passes of 1..max(call_rows, pass_rows) rows bit-identical to solo passes on
    this model (`kv_pool`: the requests' caches as the engine makes them, see
    server/engine/guarantee/deployment.py; `compiled`: the passes compiled, over the pool's kernel).
    Widths are proven in order, each on its own: `on_width(w)` is called once 1..w are.
    `proven`: widths 1..proven were proven before (a partial record): only wider ones run, and only
    the pool members they use are prefilled."""
    from ..invariance.layers import calls_in_blocks
    from .compiled_pass import CompiledPasses, NotCompilable

    start = time.perf_counter()
    if call_rows < 1:
        return RaggedProof(False, call_rows, (), "the limit is 0")
    if compiled and kv_pool != "kernel":
        return RaggedProof(False, call_rows, (), "compiled passes run over the pool's kernel only")
    widest = max(call_rows, pass_rows or call_rows)
    widths = tuple(range(1, widest + 1))
    if not 0 <= proven <= widest:
        raise ValueError(f"proven widths 1..{proven} outside 1..{widest}")
    if proven == widest:  # nothing left to prove: no caches, prefills or compiled passes either
        return RaggedProof(True, call_rows, widths, "", time.perf_counter() - start)
    vocab = vocab or _vocab_size(model)
    key = mx.random.key(seed)
    pool = _pool(call_rows, widest)
    used = sorted({i for width in widths[proven:] for i in _members_for(width, pool)})
    # held at once: the members' prefixes, and one width's copies (at most one per member)
    made = _Caches(model, kv_pool, max(prefix + rows for prefix, rows in pool), held=2 * len(used))
    prompts, caches = {}, {}
    member_keys = mx.random.split(key, len(pool))
    for i in used:  # each member's tokens depend on its index only, whichever members run
        prefix, rows = pool[i]
        tokens = mx.random.randint(0, vocab, (prefix + rows,), key=member_keys[i]).tolist()
        cache = made.new()
        model(mx.array(tokens[:prefix])[None], cache=cache)
        mx.eval([c.state for c in cache])
        prompts[i] = tokens[prefix:]
        caches[i] = cache
        step_done()  # the pool's passes before the first width are many: each is a step

    solo = {}
    for i in used:
        prefix = pool[i][0]
        cache = made.copy(caches[i])
        logits = ragged_forward(model, [(cache, prompts[i])])[0]
        kv = new_state(cache, prefix)
        mx.eval(logits, kv)
        solo[i] = (logits, kv)
        made.release([cache])
        step_done()

    passes = CompiledPasses(model, made.pool) if compiled else None
    for width in widths[proven:]:
        members = _members_for(width, pool)
        fresh = [made.copy(caches[i]) for i in members]
        requests = [(fresh[j], prompts[i]) for j, i in enumerate(members)]
        if passes is not None:
            try:
                outs = per_request(passes.logits(requests, canonical=True), requests)
            except NotCompilable as exc:
                return RaggedProof(False, call_rows, widths, f"compiled passes: {exc}", time.perf_counter() - start,
                                   proven_widths=width - 1)
        else:
            with calls_in_blocks():
                outs = ragged_forward(model, requests)
        mx.eval(outs)
        for j, i in enumerate(members):
            logits, kv = solo[i]
            if not _same(outs[j], logits):
                return RaggedProof(False, call_rows, widths, f"logits of a {pool[i][1]}-row request differ "
                                   f"in a ragged pass of {width} rows", time.perf_counter() - start,
                                   proven_widths=width - 1)
            layer = differing_layer(kv, new_state(fresh[j], pool[i][0]))
            if layer is not None:
                return RaggedProof(False, call_rows, widths, f"layer {layer} state of a {pool[i][1]}-row "
                                   f"request differs in a ragged pass of {width} rows",
                                   time.perf_counter() - start, proven_widths=width - 1)
        made.release(fresh)
        if on_width is not None:
            on_width(width)
        step_done()
    return RaggedProof(True, call_rows, widths, "", time.perf_counter() - start)


def prove_ragged_cached(model, call_rows: int, proof_cache=None, *, seed: int = 0,
                        kv_pool: str = "off", pass_rows: int | None = None, compiled: bool = False,
                        on_width: Callable[[int], None] | None = None,
                        credit_from: int | None = None) -> RaggedProof:
    """`prove_ragged`, re-using a result proven earlier on this machine (a
    kernels.invariance.selftest.ProofCache: same model, strategy, L, widths, code, MLX and device;
    `on_width` is called only while proving). Each width proven is kept at once under the same
    key, marked partial: a proof stopped after width w resumes from w + 1, calling `on_width(w)`
    first, before any pass. A failed proof's record keeps the widths proven before the failure.
    `credit_from`: the widest pass of a wider proof of this deployment (its key this one's but for
    its widths, 1..credit_from): the widths its record holds as proven count here too (the
    fallback after a wider proof failed, to its widths passed or L)."""
    if proof_cache is None:
        return prove_ragged(model, call_rows, seed=seed, kv_pool=kv_pool, pass_rows=pass_rows, compiled=compiled,
                            on_width=on_width)
    widths = tuple(range(1, max(call_rows, pass_rows or call_rows) + 1))
    key = ragged_proof_key(model, call_rows, widths, proof_cache, seed=seed, kv_pool=kv_pool, compiled=compiled)
    store = proof_cache.store
    value = None if proof_cache.fresh else store.get(key)
    finished = _finished(value, call_rows, widths)
    if finished is not None:
        return finished
    resumed = _proven_before(value, store, key, len(widths))
    if resumed:
        log.info("ragged proof: passes of 1..%d rows were proven by an earlier start that stopped mid-proof; "
                 "proving %s", resumed, f"{resumed + 1}..{len(widths)} rows" if resumed < len(widths) else "no more")
    credited = 0
    if credit_from is not None and credit_from > len(widths) and not proof_cache.fresh:
        wider = {**key, "widths": list(range(1, credit_from + 1))}
        credited = min(len(widths), _proven_by(store.get(wider), store, wider, credit_from))
        if credited > resumed:
            log.info("ragged proof: passes of 1..%d rows were proven by the proof of 1..%d rows; proving %s",
                     credited, credit_from,
                     f"{credited + 1}..{len(widths)} rows" if credited < len(widths) else "no more")
    resumed = max(resumed, credited)
    if resumed and on_width is not None:
        on_width(resumed)
    start = time.perf_counter()

    def kept(width: int) -> None:  # called once 1..width passed their comparisons
        store.put(key, {"partial": True, "proven_widths": width, "seconds": time.perf_counter() - start})
        if on_width is not None:
            on_width(width)

    proof = prove_ragged(model, call_rows, seed=seed, kv_pool=kv_pool, pass_rows=pass_rows, compiled=compiled,
                         on_width=kept, proven=resumed)
    proof = replace(proof, resumed=resumed)
    store.put(key, {**_record(proof), **({} if proof.passed else {"proven_widths": proof.proven_widths})})
    return proof


def ragged_proof_key(model, call_rows: int, widths: tuple, proof_cache, *, seed: int = 0, kv_pool: str = "off",
                     compiled: bool = False) -> dict:
    """The key a ragged proof of `widths` is kept under: the self-test's (model, strategy, L,
    code, MLX, device) and the KV layout, and whether its passes are compiled."""
    from ..invariance.selftest import proof_key

    return {**proof_key(model, call_rows, widths, (), seed, True, proof_cache.model_identity),
            "what": "ragged pass proof", **({"kv_pool": kv_pool} if kv_pool != "off" else {}),
            **({"compiled": True} if compiled else {})}


def cached_proof(proof_cache, key: dict, call_rows: int, widths: tuple, prove) -> RaggedProof:
    """The proof kept under `key` in `proof_cache` (a ProofCache), else prove() and keep it."""
    value = None if proof_cache.fresh else proof_cache.store.get(key)
    finished = _finished(value, call_rows, widths)
    if finished is not None:
        return finished
    proof = prove()
    proof_cache.store.put(key, _record(proof))
    return proof


def _record(proof: RaggedProof) -> dict:
    return {"passed": proof.passed, "reason": proof.reason, "seconds": proof.seconds}


def _finished(value: dict | None, call_rows: int, widths: tuple) -> RaggedProof | None:
    """The finished proof a stored value holds, or None (nothing stored, or a partial record)."""
    if isinstance(value, dict) and isinstance(value.get("passed"), bool):
        proven = 0 if value["passed"] else _failed_widths(value, len(widths)) or 0
        return RaggedProof(value["passed"], call_rows, widths, str(value.get("reason", "")), 0.0, cached=True,
                           proven_widths=proven)
    return None


def _failed_widths(value: dict, widest: int) -> int | None:
    """The widths 1..w a failed proof of 1..widest passed before it failed (None: not a count
    of them; an older record without one counts none)."""
    width = value.get("proven_widths", 0)
    return width if type(width) is int and 0 <= width < widest else None


def _proven_before(value: dict | None, store, key: dict, widest: int) -> int:
    """The widths 1..w a partial record says were proven (0: none, or a record of another
    shape, ignored with a warning)."""
    if value is None:
        return 0
    width = value.get("proven_widths")
    if value.get("partial") is True and type(width) is int and 1 <= width <= widest:
        return width
    log.warning("ignoring a ragged proof record that is neither finished nor a partial proof of 1..%d rows "
                "(%s): proving every width again", widest, store.path(key))
    return 0


def _proven_by(value: dict | None, store, key: dict, widest: int) -> int:
    """The widths 1..w a record of a proof of 1..widest holds as proven: all of them if it
    passed, those before the failure if it failed, those kept if partial (0: none, an older
    failed record, or a record of another shape, ignored with a warning)."""
    if value is None:
        return 0
    if value.get("passed") is True:
        return widest
    if value.get("passed") is False:
        width = _failed_widths(value, widest)
        if width is not None:
            return width
        log.warning("ignoring the widths a failed ragged proof record says were proven (%s)", store.path(key))
        return 0
    return _proven_before(value, store, key, widest)


def differing_layer(want: list, got: list) -> int | None:
    """The first layer whose state arrays (new_state) differ as raw bits; None: all equal."""
    for layer, (a, b) in enumerate(zip(want, got)):
        if len(a) != len(b) or not all(_same(x, y) for x, y in zip(a, b)):
            return layer
    return None


def _vocab_size(model) -> int:
    args = getattr(model, "args", None)
    return int(getattr(args, "vocab_size", 256))


def per_request_self_test(model, call_rows: int, *, prefixes=None, widths=None, seed: int = 0,
                          stop_at_first: bool = True,
                          proof_cache: ProofCache | None = None) -> SelfTestResult:
    """The self-test of a model with per-request state: for each length p in `prefixes`,
    requests holding random prompts of p, p + 1, ... tokens; for each width M in `widths`
    (default: sample_widths(L)) the decode rows of M of them in one ragged pass, each
    request's logits and new state compared with its one-row pass alone (from copies of the
    same caches). Proves what such a model's guarantee claims: one row per request per pass."""
    return proven(_per_request_self_test, "one row per request", model, call_rows, prefixes, widths,
                   seed, stop_at_first, proof_cache)


def _per_request_self_test(model, call_rows: int, prefixes, widths: tuple, seed: int,
                           stop_at_first: bool) -> SelfTestResult:
    result = result_maker(call_rows, widths, prefixes)

    if not widths:
        return result(reason=f"nothing to prove for L={call_rows}")
    problem = cache_refusal(make_prompt_cache(model))
    if problem:
        return result(reason=f"cache: {problem}")
    problem = ragged_problem(model)
    if problem:
        return result(reason=f"requests cannot share a pass: {problem}")
    enable_ragged(model)
    vocab = _vocab_size(model)
    key = mx.random.key(seed)
    members = max(widths)
    mismatches = []
    for prefix in prefixes:
        key, k1, k2 = mx.random.split(key, 3)
        prompts = mx.random.randint(0, vocab, (members, prefix + members), key=k1)
        rows = mx.random.randint(0, vocab, (members,), key=k2).tolist()
        caches = []
        for j in range(members):  # request j holds prefix + j tokens: every row at its own position
            cache = make_prompt_cache(model)
            model(prompts[j : j + 1, : prefix + j], cache=cache)
            mx.eval([c.state for c in cache])
            caches.append(cache)
            step_done()  # each pass before the widths' is a step too
        alone = []
        for j in range(members):
            own = copy.deepcopy(caches[j])
            logits = ragged_forward(model, [(own, [rows[j]])])[0]
            state = new_state(own, prefix + j)
            mx.eval(logits, state)
            alone.append((logits, state))
            step_done()
        for w in widths:
            together = [copy.deepcopy(caches[j]) for j in range(w)]
            outs = ragged_forward(model, [(together[j], [rows[j]]) for j in range(w)])
            mx.eval(outs)
            for j in range(w):
                logits, state = alone[j]
                if not bits_equal(outs[j], logits):
                    mismatches.append(Mismatch(prefix + j, w, j, "logits", max_diff(outs[j], logits)))
                got = new_state(together[j], prefix + j)
                for layer, (want_arrays, got_arrays) in enumerate(zip(state, got)):
                    for a, b in zip(want_arrays, got_arrays):
                        if not bits_equal(a, b):
                            diff = max_diff(a, b) if a.shape == b.shape else float("inf")
                            mismatches.append(Mismatch(prefix + j, w, -1, f"layer {layer} state", diff))
                            break
            if mismatches and stop_at_first:
                return result(mismatches)
            step_done()
    return result(mismatches)
