"""Adaptive speculation in the engine: the batch-full hook cuts drafts, never tokens.

Deterministic requests speculate with adaptive k (flat pass costs, so k grows on these
repetitive prompts) on the shape-variant double (tests/doubles/shape_variant.py), where any pass
wider than the rule allows would change bits. The same requests run with the engine's
batch-full hook (`Engine.draft_room`) on and off: the hook only changes how many drafts a
pass verifies, so every token and logprob bit must be the same either way.
"""
import asyncio
import struct

from tests.doubles.shape_variant import shape_variant_backend
from lockstep.kernels.invariance import set_batch_invariant_limit
from lockstep.server.engine.guarantee.decode_plan import plan_request
from lockstep.server.engine.guarantee.deployment import proven_deployment
from lockstep.server.engine.decoding.request_state import GenerationRequest
from lockstep.server.engine.decoding.sampling import SamplingParams
from tests.deterministic_fixtures import TinyLoaded
from tests.test_deterministic_double import peaked_llama
from tests.test_batching import PassLog

LIMIT = 6
TOKENS = 20
PROMPTS = [[11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12], [30, 31, 32, 33, 30, 31, 32],
           [50, 51, 52, 53, 54, 50, 51, 52, 53], [70, 71, 70, 71, 70], [20, 21, 22, 20, 21, 22, 20]]
SAMPLINGS = [SamplingParams(temperature=0.0, top_logprobs=2), SamplingParams(temperature=0.8, seed=3, top_logprobs=2)]


def run_engine(draft_room: bool):
    """Every (prompt, sampling) pair at once, deterministic, adaptive prompt lookup up to k = 5:
    {request: (tokens, logprob bits)}, drafted tokens per request, and the pass log."""
    from lockstep.server.engine import Engine

    model = peaked_llama()
    with shape_variant_backend():
        invariance = set_batch_invariant_limit(model, LIMIT)
    assert invariance.guaranteed
    with shape_variant_backend():
        deployment = proven_deployment(model, invariance, prefill_chunk=8, adaptive_draft_tokens=True,
                                       pass_costs=(1.0,) * LIMIT)
    log = PassLog()

    async def main():
        with shape_variant_backend():
            engine = Engine(TinyLoaded(model), max_active=16, deployment=deployment)
        engine.scheduler.draft_room = draft_room
        engine.observers.append(log)
        engine.start()
        try:
            handles = {}
            for p, prompt in enumerate(PROMPTS):
                for s, sampling in enumerate(SAMPLINGS):
                    request = GenerationRequest(prompt, TOKENS, sampling)
                    decode_plan = plan_request(deployment, deterministic=True, speculative="prompt_lookup",
                                               num_draft_tokens=5)
                    assert decode_plan.adaptive
                    handles[(p, s)] = engine.submit(request, decode_plan)
            results, drafted = {}, {}
            for key, handle in handles.items():
                text, bits = "", []
                async for delta in handle:
                    text += delta.text
                    bits += [struct.pack(">d", lp.logprob) for lp in delta.logprobs]
                    if delta.finish_reason:
                        drafted[key] = delta.report.drafted_tokens
                results[key] = ([ord(ch) - 0x4E00 for ch in text], bits)
            return results, drafted
        finally:
            engine.stop()

    with shape_variant_backend():
        results, drafted = asyncio.run(main())
    return results, drafted, log.passes


def test_the_batch_full_hook_changes_drafts_and_passes_but_no_deterministic_bit():
    on, drafted_on, passes_on = run_engine(draft_room=True)
    off, drafted_off, passes_off = run_engine(draft_room=False)
    assert all(len(tokens) == TOKENS for tokens, _ in off.values())
    assert on == off  # tokens and logprob bits, request by request
    assert sum(drafted_off.values()) > sum(drafted_on.values())  # the hook did cut drafts
    assert all(rows <= LIMIT for rows, _ in passes_on + passes_off)
