"""The guarantee on the GPU, end to end, where MLX's own kernels vary with a call's shape (dense
GEMM from 2 rows, quantized from 8, SDPA by blocks: docs/DETERMINISM.md), so that a row
which leaves lockstep's canonical forms shows: on the CPU every row keeps its bits anyway.

A Llama-3-8B's layer widths (hidden 4096, intermediate 14336, 32 / 8 heads of 128) with two
layers and random weights, made on the device; the vocabulary is 32,000 so that every id reads
back through tests/deterministic_fixtures.CharTokenizer (higher ids reach the surrogates).
- the startup self-test proves the kernels' forms for L on this GPU;
- the boundary is sharp: a call of L rows gives each row its bits alone; a call of L + 1 rows
  does not (it runs MLX's own call), unless it runs in blocks of L; so a change that lets
  L + 1 rows through one call (a verification of L + 1 rows, an off-by-one block) fails here;
- deterministic requests decoded together, with Predicted Outputs and in shared passes, get
  the tokens and logprob bits each gets decoded alone without speculation; the same requests
  with `deterministic: false` do not (the control diverges).
"""
import asyncio
import struct
from contextlib import nullcontext
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama

from lockstep.kernels.batching.ragged import enable_ragged
from lockstep.kernels.invariance import set_batch_invariant_limit
from lockstep.kernels.invariance.layers import calls_in_blocks
from lockstep.kernels.invariance.selftest import bits_equal
from lockstep.server.engine import Engine
from lockstep.server.engine.guarantee.decode_plan import plan_request
from lockstep.server.engine.guarantee.deployment import proven_deployment
from lockstep.server.engine.runner.model_runner import ModelRunner
from lockstep.server.engine.decoding.request_report import rendered
from lockstep.server.engine.decoding.request_state import GenerationRequest
from lockstep.server.engine.decoding.sampling import SamplingParams
from tests.deterministic_fixtures import TinyLoaded
from tests.gpu.cuda_cases import HIDDEN, INTERMEDIATE, SMOL_HIDDEN, SMOL_INTERMEDIATE, SMOL_VOCAB

pytestmark = pytest.mark.gpu

LIMIT = 8  # L of the deployment under test
VOCAB = 32000
CONTEXT = 40  # tokens in the cache before the rows under test
QUANTIZATION = {"bf16": None, "nvfp4": ("nvfp4", 16, 4)}


def eight_b_layers(weights: str, layers: int = 2, seed: int = 0):
    """A Llama-3-8B-shaped model of `layers` layers, random bf16 weights (quantized on request)."""
    args = llama.ModelArgs(model_type="llama", hidden_size=HIDDEN, num_hidden_layers=layers,
                           intermediate_size=INTERMEDIATE, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=128, rms_norm_eps=1e-5, vocab_size=VOCAB, rope_theta=500000.0,
                           tie_word_embeddings=False)
    return _random(args, weights, seed)


def smollm2_layers(weights: str, layers: int = 1, seed: int = 0):
    """A SmolLM2-135M-shaped model (hidden 576, 9 / 3 heads of 64, intermediate 1536, tied head of
    49,152), random bf16 weights (quantized on request)."""
    args = llama.ModelArgs(model_type="llama", hidden_size=SMOL_HIDDEN, num_hidden_layers=layers,
                           intermediate_size=SMOL_INTERMEDIATE, num_attention_heads=9, num_key_value_heads=3,
                           head_dim=64, rms_norm_eps=1e-5, vocab_size=SMOL_VOCAB, rope_theta=100000.0,
                           tie_word_embeddings=True)
    return _random(args, weights, seed)


def _random(args, weights: str, seed: int):
    mx.random.seed(seed)
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    if QUANTIZATION[weights]:
        mode, group, bits = QUANTIZATION[weights]
        nn.quantize(model, group_size=group, bits=bits, mode=mode)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module", params=list(QUANTIZATION))
def deployed(request):
    """(loaded model, its proven deployment for L = LIMIT, the installed invariance, weights)."""
    model = eight_b_layers(request.param)
    enable_ragged(model)
    invariance = set_batch_invariant_limit(model, LIMIT)
    deployment = replace(proven_deployment(model, invariance, kv_pool="kernel", pass_rows=2 * LIMIT), prefill_chunk=8)
    yield TinyLoaded(model, weights=request.param), deployment, invariance, request.param
    set_batch_invariant_limit(model, 0)
    del model
    mx.clear_cache()


def test_the_self_test_proves_the_kernels_forms_for_l_on_this_gpu(deployed):
    _, deployment, invariance, weights = deployed
    assert invariance.guaranteed, invariance.reason
    assert invariance.strategy != "native" and "gpu" in invariance.backend
    assert deployment.guarantee.guaranteed and deployment.guarantee.shared_passes
    assert deployment.guarantee.call_rows == LIMIT
    if weights == "bf16":  # CUDA, 16-bit: the 8B's dense layers' rows on tensor cores (mma_rows.py)
        assert invariance.strategy == "mma_rows"


def rows_kept(model, tokens: list, blocks: bool = False) -> int:
    """How many rows of one pass of `tokens` (after CONTEXT tokens of KV), as the engine runs a
    request's pass (over the KV pool; `blocks`: as it runs a deterministic pass), equal bit for
    bit the same tokens passed one at a time in order (decode steps)."""
    runner = ModelRunner.as_engine_runs(model, "kernel", pool_tokens=CONTEXT + len(tokens) + 64)
    cache = runner.new_cache(CONTEXT + len(tokens) + 1)
    prompt = mx.random.randint(0, VOCAB, (CONTEXT,), key=mx.random.key(1)).tolist()
    mx.eval(runner.forward_rows(cache, prompt), [c.state for c in cache])
    with calls_in_blocks() if blocks else nullcontext():
        block = runner.forward_rows(cache, tokens)
    mx.eval(block)
    for c in cache:
        c.trim(len(tokens))
    kept = 0
    for i, token in enumerate(tokens):
        one = runner.forward_rows(cache, [token])
        mx.eval(one)
        kept += bits_equal(block[i], one[0])
    runner.release(cache)
    return kept


def test_l_rows_keep_their_bits_and_l_plus_1_rows_in_one_call_do_not(deployed):
    """Calls of L rows, and of 2L + 1 in blocks of L, keep every row's bits. bf16: MLX's dense
    GEMM (from 2 rows) rounds otherwise than its single-row GEMV, so the (L + 1)-row call, which
    leaves the canonical forms, must lose bits. (nvfp4 runs its large 4-bit layers through
    lockstep's row kernels even in plain calls, so there an L + 1 call may keep its bits: the
    boundary is asserted on bf16.)"""
    loaded, _, _, weights = deployed
    model = loaded.model
    tokens = mx.random.randint(0, VOCAB, (2 * LIMIT + 1,), key=mx.random.key(2)).tolist()
    assert rows_kept(model, tokens[:LIMIT]) == LIMIT
    assert rows_kept(model, tokens, blocks=True) == 2 * LIMIT + 1  # wider calls in blocks of L
    if weights == "bf16":
        assert rows_kept(model, tokens[: LIMIT + 1]) < LIMIT + 1  # a wrong block of L + 1 rows is caught


def test_a_small_quantized_models_wide_deterministic_calls_run_one_launch_each_and_keep_the_row_bits(monkeypatch):
    """A SmolLM2's nvfp4 layers are below lockstep's own 4-bit kernels' size, so their canonical
    row is MLX's GEMV and a deterministic call of 2..64 rows one qmv_rows launch in its order:
    a pass of 2L rows and one of 4L under calls_in_blocks launch each linear once (the seven of
    the layer and the tied head) and every row has the bits of its one-row pass."""
    from lockstep.kernels.custom import qmv_rows

    model = smollm2_layers("nvfp4")
    enable_ragged(model)
    invariance = set_batch_invariant_limit(model, LIMIT)
    try:
        assert invariance.guaranteed, invariance.reason
        launched = []
        run = qmv_rows.run
        monkeypatch.setattr(qmv_rows, "run", lambda launch, mode, x, *a: launched.append(x.size // x.shape[-1]) or run(
            launch, mode, x, *a))
        for rows in (2 * LIMIT, 4 * LIMIT):
            tokens = mx.random.randint(0, VOCAB, (rows,), key=mx.random.key(rows)).tolist()
            launched.clear()
            assert rows_kept(model, tokens, blocks=True) == rows
            assert launched == [rows] * 8, launched  # the one-row passes: MLX's own GEMV
    finally:
        set_batch_invariant_limit(model, 0)


# -- the engine: deterministic requests, speculation and batching ----------------------------

def sampling(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, seed=seed, top_logprobs=2)


REQUESTS = {name: GenerationRequest(prompt, tokens, sampling(seed))
            for name, prompt, tokens, seed in (("a", [11, 12, 13, 14, 15], 12, 1), ("b", [20, 21, 22], 10, 2),
                                               ("c", [30], 9, 3))}


def decode(loaded, deployment, requests: dict, plans: dict) -> dict:
    """Every request's (token ids, logprob bits, lockstep extension), all queued before the
    engine starts, so that runs of the same requests schedule the same passes."""
    engine = Engine(loaded, max_active=8, deployment=deployment)
    out = {}

    async def main():
        handles = {name: engine.submit(request, plans[name]) for name, request in requests.items()}
        engine.start()

        async def consume(name, handle):
            text, bits, extension = "", [], None
            async for delta in handle:
                text += delta.text
                bits += [struct.pack(">d", v) for lp in delta.logprobs for v in [lp.logprob] + [v for _, v in lp.top]]
                extension = rendered(delta.report) or extension
            out[name] = ([ord(ch) - 0x4E00 for ch in text], bits, extension)

        await asyncio.gather(*(consume(n, h) for n, h in handles.items()))

    try:
        asyncio.run(main())
    finally:
        engine.stop()
    return out


def answers(runs: dict) -> dict:
    return {name: (tokens, bits) for name, (tokens, bits, _) in runs.items()}


def test_deterministic_requests_with_predictions_in_shared_passes_keep_their_solo_bits(deployed):
    loaded, deployment, _, weights = deployed

    def plan(deterministic: bool, prediction: bool = False):
        return plan_request(deployment, deterministic=deterministic, speculative=None if prediction else "none",
                            num_draft_tokens=None, prediction=prediction)

    def solo(deterministic: bool) -> dict:
        runs = {}
        for name, request in REQUESTS.items():
            runs.update(decode(loaded, deployment, {name: request}, {name: plan(deterministic)}))
        return runs

    alone = solo(True)
    # a: predicts its own answer (drafts accepted); b: a wrong prediction (drafts rejected); c: none
    predicted = {"a": replace(REQUESTS["a"], prediction=tuple(alone["a"][0])),
                 "b": replace(REQUESTS["b"], prediction=tuple(range(100, 110))), "c": REQUESTS["c"]}
    plans = {name: plan(True, prediction=name != "c") for name in predicted}
    assert all(plans[name].method == "prediction" and 1 <= plans[name].num_draft_tokens <= LIMIT - 1
               for name in "ab")
    together = decode(loaded, deployment, predicted, plans)
    assert answers(together) == answers(alone)
    assert together["a"][2]["accepted_tokens"] > 0 and together["b"][2]["drafted_tokens"] > 0

    if weights == "bf16":  # the control: the same requests and passes without the guarantee diverge
        plain_alone = solo(False)
        plain_plans = {name: plan(False, prediction=name != "c") for name in predicted}
        plain_together = decode(loaded, deployment, predicted, plain_plans)
        assert answers(plain_together) != answers(plain_alone)
