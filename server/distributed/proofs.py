"""Startup proofs that every rank agrees on.

Batch invariance is installed and self-tested on every rank's shard (kernels/invariance/limit.py
tries candidate strategies in turn, each proven by kernels/invariance/selftest.py). Each proof runs
forward passes, which are collectives on a sharded model, so the ranks must run the same
passes and reach the same verdict: the logits are the same on every rank, but each rank
compares the KV of its own heads or layers, which could differ on one rank alone. While
`agreed_proofs` is active (around `build_runtime` and the engine's construction):
- the self-test runs every width and prefix (no early stop that one rank alone would take),
- each proof's verdict is exchanged, and a proof passes only where it passed on every rank
  (the reason names the ranks where it failed), so all ranks choose the same strategy.
The ragged-pass proof stops at its first difference; a KV difference on one rank only
would leave the others waiting in the next pass: the startup watchdog then ends them.
"""
from __future__ import annotations

import dataclasses
import json
from contextlib import contextmanager

from lockstep.server.distributed.collectives import gather_bytes
from lockstep.server.distributed.world import World


def _agree(world: World, result):
    verdicts = [json.loads(b) for b in gather_bytes(
        world.group, json.dumps([bool(result), str(result.reason)[:1000]]).encode())]
    failed = [(rank, why) for rank, (passed, why) in enumerate(verdicts) if not passed]
    if not failed:
        return result
    reason = "; ".join(f"rank {rank}: {why}" for rank, why in failed)
    return dataclasses.replace(result, passed=False, reason=reason)


def _rank_widths_dropped(proof):
    return proof if proof else dataclasses.replace(proof, proven_widths=0)


@contextmanager
def agreed_proofs(world: World):
    import lockstep.kernels.invariance.limit as invariant
    import lockstep.kernels.batching.ragged_selftest as ragged

    own_self_test, own_prove, own_cached = invariant.self_test, ragged.prove_ragged, ragged.prove_ragged_cached

    def self_test(model, call_rows, **options):
        options["stop_at_first"] = False
        return _agree(world, own_self_test(model, call_rows, **options))

    # A failed ragged proof's widths passed are this rank's, not the agreed ones: a fallback as
    # wide as them, or credited by them, could run other passes (collectives) than another
    # rank's. So every rank falls back to L and proves it.
    def prove_ragged(model, call_rows, **options):
        return _rank_widths_dropped(_agree(world, own_prove(model, call_rows, **options)))

    def prove_ragged_cached(model, call_rows, proof_cache=None, **options):
        options.pop("credit_from", None)
        return _rank_widths_dropped(_agree(world, own_cached(model, call_rows, proof_cache, **options)))

    invariant.self_test, ragged.prove_ragged, ragged.prove_ragged_cached = self_test, prove_ragged, prove_ragged_cached
    try:
        yield
    finally:
        invariant.self_test, ragged.prove_ragged, ragged.prove_ragged_cached = own_self_test, own_prove, own_cached
