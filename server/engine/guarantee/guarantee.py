"""What a deployment guarantees, decided once, at startup, and nowhere else.

`decide_guarantee` turns the installed invariance (kernels/invariance/limit.py: the self-test
proved the forms on the running backend, or not) and the proofs made here into one
`Guarantee`:
- L, the rows one kernel call may hold with every row bit-identical to its one-row call,
  and whether the self-test (kernels/invariance/selftest.py) proved it;
- whether rows of *different* requests may share such a pass: the ragged proof
  (kernels/batching/ragged_selftest.py), made here only, over the KV layout the engine uses;
- whether deterministic requests' prompt chunks (of at least `shared_chunk_rows(L)` rows) may
  share a pass: the shared-prefill proof (kernels/batching/shared_prefill_proof.py), made
  after the ragged one;
- whether a deterministic prompt may be cut anywhere into chunks of that many rows, so a
  prefix-cache hit resumes where it ends: the split proof
  (kernels/batching/split_prefill_proof.py), made with the shared-prefill one;
- whether deterministic decode passes may run compiled (kernels/batching/compiled_pass.py):
  the ragged proof once more, its passes compiled, where the deployment compiles passes;
- how many deterministic rows of one sampling group may be sampled as one batch
  (`sampling_rows`): the batched-sampling proof (server/engine/decoding/sampling_proof.py), made
  once the passes are proven by server/startup_work.py's `SamplingWork` (this room does not
  import the sampler); 0 until then.

A model with per-request state (a recurrent, conv or sliding-window cache) is proven for one
row per request (`Guarantee.request_rows` = 1): its deterministic requests share decode
passes of at most L rows, one row each, and never speculate (k = 0); its state is neither
rewound nor stored in the prefix cache.

The `Deployment` holds it as `deployment.guarantee` (server/engine/guarantee/deployment.py);
`plan_request` turns it into each request's plan, and the engine reads nothing else.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

# The strategy a deployment names until its proof has chosen one
PENDING_STRATEGY = "pending"


@dataclass(frozen=True)
class Guarantee:
    """The deployment's batch-invariance guarantee.

    `call_rows` is L as configured (`--batch-invariant-limit`; 0: off): the most rows one
    kernel call may hold with every row bit-identical to the same row's one-row call. It
    bounds a call, not a pass: a pass may hold up to `pass_rows` rows, its wider calls then
    run in blocks of at most L rows; one request's rows in a pass are at most L
    (verification: k + 1 <= L). It holds only where `proven`."""

    call_rows: int = 0
    proven: bool = False  # the self-test proved L on this backend, every part of the model covered
    strategy: str = "native"  # the canonical kernel strategy installed (kernels/invariance/ops.py)
    reason: str = ""  # why it holds or not, in the self-test's words
    # Rows of one request a proven call may hold: L, or 1 where a layer keeps per-request state
    request_rows: int = 0
    shared_passes: bool = False  # requests' deterministic rows may share a pass (the ragged proof)
    pass_rows: int = 0  # the widest pass proven to hold deterministic rows of several requests
    shared_prefill_rows: int = 0  # deterministic prompt chunks of this many rows may share a pass (0: none)
    # A prompt may be cut anywhere into chunks of at least this many rows, each position's KV the
    # same (kernels/invariance/prefill.py; 0: chunks end on the grid)
    prefill_split_rows: int = 0
    compiled_canonical_passes: bool = False  # deterministic decode passes may run compiled
    # Deterministic rows of one sampling group may be sampled as one batch of this many rows or
    # of a power of two below it (sampling.block_widths; server/engine/decoding/sampling_proof.py,
    # proven after the passes; under 2: each alone)
    sampling_rows: int = 0

    @classmethod
    def installed(cls, invariance) -> Guarantee:
        """What the installed `invariance` (kernels.invariance.limit.InstalledInvariance) gives
        on its own: L, proven or not, with no pass shared between requests."""
        return cls(invariance.call_rows, invariance.guaranteed, invariance.strategy, invariance.reason,
                   invariance.request_rows)

    @property
    def guaranteed(self) -> bool:
        return self.proven and self.call_rows > 0

    @property
    def canonical_rows(self) -> int:
        """The most rows of one request's call (a prompt chunk) that get their one-row bits: 0
        unless guaranteed (kernels/invariance/prefill.py resumes prompt chunks by it)."""
        return min(self.call_rows, self.request_rows or self.call_rows) if self.guaranteed else 0


def decide_guarantee(model, invariance, kv_pool: str = "off", proofs=None, pass_rows: int | None = None,
                     shared_prefill: bool = True, compiled: bool = False, on_width=None,
                     prefill_chunk: int = 0) -> Guarantee:
    """The deployment's guarantee for `model` with the installed `invariance`
    (a kernels.invariance.limit.InstalledInvariance or None); `proofs` a ProofCache to re-use
    a ragged proof made earlier on this machine. `pass_rows`: the widest pass the engine will
    build (`--max-batch-rows`): L bounds one kernel call, not a pass, so the ragged proof covers
    every width up to it (calls of more than L rows run in blocks of at most L); if that fails,
    passes as wide as the widths it passed (at least L) are proven instead. `shared_prefill` False: no shared-prefill
    proof, deterministic prompt chunks run alone (a distributed deployment: its pipeline
    hands a prompt chunk on through a KV cache, which a ragged pass does not have); with it, where
    `prefill_chunk` is given, the split proof on a prompt of that many tokens. `compiled`:
    the deployment compiles its plain passes over the pool's kernel; deterministic ones then
    too where the ragged proof holds for compiled passes of every width proven. `on_width(w)`:
    called while a first ragged proof goes, once passes of 1..w rows are proven."""
    if invariance is None:
        return Guarantee(reason="no batch-invariant limit")
    installed = Guarantee.installed(invariance)
    if not installed.guaranteed:
        return installed
    from lockstep.kernels.batching.ragged import enable_ragged, ragged_problem
    from lockstep.kernels.batching.ragged_selftest import prove_ragged_cached

    problem = ragged_problem(model)
    if problem is not None:
        log.warning("requests are not batched into shared passes (%s): deterministic requests get "
                    "passes of their own", problem)
        return installed
    enable_ragged(model)
    limit = installed.call_rows
    widest = max(limit, pass_rows or limit)
    proof = prove_ragged_cached(model, limit, proofs, kv_pool=kv_pool, pass_rows=widest, on_width=on_width)
    if not proof and widest > limit:
        # each width is proven on its own: those the wider proof passed stay proven (and count
        # as proven in the fallback's record), so only a failure below L costs passes wider than L
        fallback = max(limit, proof.proven_widths)
        log.warning("ragged passes of up to %d rows not proven (%s): trying passes of at most %d rows (L = %d)",
                    widest, proof.reason, fallback, limit)
        proof = prove_ragged_cached(model, limit, proofs, kv_pool=kv_pool, pass_rows=fallback, credit_from=widest)
        widest = fallback
    if not proof:
        log.warning("ragged passes not proven (%s): deterministic requests get passes of their own",
                    proof.reason)
        return installed
    log.info("ragged passes of 1..%d rows proven bit-identical to solo passes (%.1f s%s)", widest, proof.seconds,
             f"; 1..{proof.resumed} rows kept from an earlier proof" if proof.resumed else "")
    shared_rows = _shared_prefill(model, limit, kv_pool, proofs) if shared_prefill else 0
    return dataclasses.replace(
        installed, shared_passes=True, pass_rows=widest, shared_prefill_rows=shared_rows,
        prefill_split_rows=_prefill_splits(model, limit, kv_pool, proofs, prefill_chunk) if shared_rows else 0,
        compiled_canonical_passes=compiled and kv_pool == "kernel" and _compiled(model, limit, proofs, widest))


def _compiled(model, limit: int, proofs, widest: int) -> bool:
    """Whether compiled passes of 1..widest rows give every row its solo pass's bits."""
    from lockstep.kernels.batching.ragged_selftest import prove_ragged_cached

    proof = prove_ragged_cached(model, limit, proofs, kv_pool="kernel", pass_rows=widest, compiled=True)
    if proof:
        log.info("compiled passes of 1..%d rows proven bit-identical to solo passes (%.1f s)", widest, proof.seconds)
    else:
        log.warning("deterministic decode passes are built op by op: %s", proof.reason)
    return proof.passed


def _shared_prefill(model, limit: int, kv_pool: str, proofs) -> int:
    """The fewest rows a deterministic prompt chunk needs to share a prefill pass (0: none may;
    always 0 for a model with per-request state, whose prompt chunks run alone)."""
    from mlx_lm.models.cache import make_prompt_cache

    from lockstep.kernels.batching.shared_prefill_proof import prove_shared_prefill_cached, shared_chunk_rows
    from lockstep.kernels.invariance.cache_check import per_request_state

    if per_request_state(make_prompt_cache(model)) is not None:
        return 0
    rows = shared_chunk_rows(limit)
    proof = prove_shared_prefill_cached(model, limit, proofs, kv_pool=kv_pool)
    if proof:
        log.info("prompt chunks of %d rows or more proven to keep their KV in shared passes (%.1f s)",
                 rows, proof.seconds)
        return rows
    log.info("deterministic prompt chunks are prefilled in passes of their own: %s", proof.reason)
    return 0


def _prefill_splits(model, limit: int, kv_pool: str, proofs, prefill_chunk: int) -> int:
    """The fewest rows of a chunk where a deterministic prompt may be cut anywhere (0: its
    chunks end on the grid), proven on a prompt of one whole `prefill_chunk`."""
    from lockstep.kernels.batching.shared_prefill_proof import shared_chunk_rows
    from lockstep.kernels.batching.split_prefill_proof import cuts, prove_prefill_splits_cached

    rows = shared_chunk_rows(limit)
    if not cuts(prefill_chunk, rows):
        return 0
    proof = prove_prefill_splits_cached(model, limit, prefill_chunk, proofs, kv_pool=kv_pool)
    if proof:
        log.info("prompts may be cut anywhere into chunks of %d rows or more (%.1f s)", rows, proof.seconds)
        return rows
    log.info("deterministic prompts are prefilled in chunks on the grid: %s", proof.reason)
    return 0
