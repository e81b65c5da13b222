"""kernels/invariance/expert_rows.py: an MoE expert block's rows in one unsorted gather call per
projection, each row with the bits of its own decode call, and the proof that picks that form
or per-row calls.

MLX's CPU gather kernels give an element its bits in a call of any size, sorted or not, so a
wrong form could pass here unseen: every claim is also shown under the shape-variant double
(tests/doubles/shape_variant.py) as a backend like CUDA (`gather="sorted"`: an unsorted
one-row element keeps its bits, a sorted call does not), where mlx-lm's own call of 64 (row,
expert) pairs or more diverges, and as a backend whose gather kernel is batch-variant
(`gather="rows"`), where the proof must pick per-row calls.
"""
import copy
from contextlib import nullcontext

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import switch_layers

from tests.doubles.shape_variant import shape_variant_backend
from lockstep.kernels.invariance import expert_rows, layers
from lockstep.kernels.invariance.layers import LAYER_SWAPS, Setting, batch_invariant, calls_in_blocks
from lockstep.kernels.invariance.limit import set_batch_invariant_limit
from lockstep.kernels.invariance.ops import ROWWISE
from lockstep.kernels.invariance.selftest import ProofCache, bits_equal
from lockstep.kernels.verdict_cache import VerdictCache

ROWS = (1, 5, 40, 70)  # 40 and 70 rows x 2 experts: over mlx-lm's 64-pair sort threshold
MODES = {None: None, "affine4": ("affine", 64, 4), "affine8": ("affine", 64, 8), "mxfp4": ("mxfp4", 32, 4),
         "mxfp8": ("mxfp8", 32, 8), "nvfp4": ("nvfp4", 16, 4)}
EXPERTS, K = 4, 2


def block_of(kind: str, mode: str | None, bias: bool):
    mx.random.seed(3)
    block = getattr(switch_layers, kind)(128, 64, EXPERTS, bias=bias)
    if bias:  # mlx-lm starts biases at zero: make them count
        for proj in block.children().values():
            if isinstance(proj, switch_layers.SwitchLinear):
                proj.bias = mx.random.normal(proj.bias.shape)
    if MODES[mode]:
        quant_mode, group_size, bits = MODES[mode]
        nn.quantize(block, group_size=group_size, bits=bits, mode=quant_mode)
    mx.eval(block.parameters())
    return block


def inputs(rows: int, seed: int = 4):
    x = mx.random.normal((1, rows, 128), key=mx.random.key(seed))
    scores = mx.random.uniform(shape=(rows, EXPERTS), key=mx.random.key(seed + 1))
    return x, mx.argsort(scores, axis=-1)[:, :K].astype(mx.uint32)[None]


def decode(block, x, indices, i):
    """The call a one-row decode makes: x (1, 1, D), indices (1, 1, k), mlx-lm's own call."""
    return expert_rows.native_call(block)(block, x[:, i:i + 1], indices[:, i:i + 1])


def rows_equal(got, block, x, indices) -> list[bool]:
    return [bits_equal(got[:, i:i + 1], decode(block, x, indices, i)) for i in range(x.shape[1])]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["SwitchGLU", "SwitchMLP"])
def test_every_row_of_one_call_is_its_decode_call(kind, mode, bias):
    block = block_of(kind, mode, bias)
    for backend in (nullcontext, lambda: shape_variant_backend(gather="sorted")):
        with backend():
            for rows in ROWS:
                x, indices = inputs(rows)
                together = expert_rows.one_call(block, x, indices)
                assert together.shape == (1, rows, K, 128)
                assert all(rows_equal(together, block, x, indices)), (rows, backend)
    # negative control, a CUDA-like backend: mlx-lm's own call sorts its 80 and 140 pairs
    with shape_variant_backend(gather="sorted"):
        for rows in (40, 70):
            x, indices = inputs(rows)
            assert not all(rows_equal(block(x, indices), block, x, indices)), rows
    # and a backend whose gather kernel is batch-variant: the one call diverges there
    with shape_variant_backend():
        x, indices = inputs(5)
        assert not all(rows_equal(expert_rows.one_call(block, x, indices), block, x, indices))
    assert mx.allclose(expert_rows.one_call(block, x, indices), block(x, indices), atol=1e-4)


@pytest.mark.parametrize("kind", ["SwitchGLU", "SwitchMLP"])
def test_the_installed_block_runs_its_rows_in_the_settings_form(kind, monkeypatch):
    """Launch counts (a CPU row keeps its bits either way): one gather call a projection for a
    call the one-call width covers, one per block of that width beyond it, one a row per row."""
    block = block_of(kind, "nvfp4", False)
    block.__class__ = LAYER_SWAPS[type(block)]
    launches = []
    real = mx.gather_qmm
    monkeypatch.setattr(mx, "gather_qmm", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    projections = 3 if kind == "SwitchGLU" else 2
    x, indices = inputs(40)

    def count(setting, rows, blocks=False):
        launches.clear()
        with batch_invariant(setting), calls_in_blocks() if blocks else nullcontext():
            out = block(x[:, :rows], indices[:, :rows])
        calls = len(launches) // projections
        assert all(rows_equal(out, block, x[:, :rows], indices[:, :rows]))
        return calls

    assert count(Setting(40, ROWWISE, expert_call_rows=64), 40) == 1
    assert count(Setting(8, ROWWISE, expert_call_rows=16), 40, blocks=True) == 3  # 16 + 16 + 8
    assert count(Setting(8, ROWWISE), 8) == 8  # per row
    assert count(Setting(8, ROWWISE, expert_call_rows=64), 9) == 1  # L < rows: the block's own call
    assert count(None, 40) == 1


def _tiny_moe(family="qwen3_moe"):
    from tests.model_families import tiny_family

    return tiny_family(family)


def _decode_rows_of_a_pass(model, rows):
    """Each of `rows` hidden rows through the model's first expert block as one deterministic
    call, against each row alone."""
    block = next(m for _, m in model.named_modules() if isinstance(m, expert_rows.EXPERT_BLOCKS))
    x, _ = inputs(rows)
    indices = mx.random.randint(0, expert_rows._num_experts(block), (1, rows, K), key=mx.random.key(9))
    with batch_invariant(model._lockstep_setting), calls_in_blocks():
        together = block(x, indices)
    return rows_equal(together, block, x, indices)


def test_the_proof_picks_one_call_where_elements_keep_their_bits():
    model = _tiny_moe()
    for backend in (nullcontext, lambda: shape_variant_backend(gather="sorted")):
        with backend():
            invariance = set_batch_invariant_limit(model, 4, "rowwise", prefixes=(7,))
            assert invariance.guaranteed, invariance.reason
            assert invariance.expert_rows.one_call_rows == expert_rows.default_pass_rows()
            assert model._lockstep_setting.expert_call_rows == expert_rows.default_pass_rows()
            assert f"MoE experts: one call for 1..{expert_rows.default_pass_rows()} rows" in invariance.reason
            assert all(_decode_rows_of_a_pass(model, 70))
    set_batch_invariant_limit(model, 0)


def test_a_batch_variant_gather_kernel_makes_the_proof_pick_per_row():
    model = _tiny_moe()
    with shape_variant_backend():  # every gather call of several rows reduces in another order
        invariance = set_batch_invariant_limit(model, 4, "rowwise", prefixes=(7,))
        assert invariance.guaranteed, invariance.reason  # per row: the deployment keeps its guarantee
        assert invariance.expert_rows.one_call_rows == 0
        assert model._lockstep_setting.expert_call_rows == 0
        assert "MoE experts: per row (" in invariance.reason and "differs from per-row calls at width 2" \
            in invariance.reason
        assert all(_decode_rows_of_a_pass(model, 12))
        # negative control: the one-call form forced in, the self-test fails
        model._lockstep_setting = Setting(4, ROWWISE, expert_call_rows=32)
        from lockstep.kernels.invariance.selftest import self_test

        assert not self_test(model, 4, prefixes=(7,)).passed
    set_batch_invariant_limit(model, 0)


def test_a_kernel_that_changes_with_the_batch_size_keeps_one_call_below_it():
    """Elements keep their bits up to 24 per call (12 rows of top-2 in the tiny model's
    4-expert blocks): the one call covers 12 rows, a wider pass runs in blocks of 12."""
    model = _tiny_moe()
    with shape_variant_backend(gather="sorted", gather_elements=24):
        invariance = set_batch_invariant_limit(model, 4, "rowwise", prefixes=(7,))
        assert invariance.guaranteed, invariance.reason
        assert invariance.expert_rows.one_call_rows == 12, invariance.expert_rows
        assert "at width 13" in invariance.reason
        assert all(_decode_rows_of_a_pass(model, 30))
        model._lockstep_setting = Setting(4, ROWWISE, expert_call_rows=30)  # negative control
        assert not all(_decode_rows_of_a_pass(model, 30))
    set_batch_invariant_limit(model, 0)


def test_the_proof_covers_the_pass_rows_asked_for_and_per_row_when_asked():
    model = _tiny_moe()
    invariance = set_batch_invariant_limit(model, 4, "rowwise", prefixes=(7,), expert_pass_rows=20)
    assert invariance.expert_rows.one_call_rows == 20
    invariance = set_batch_invariant_limit(model, 4, "rowwise", prefixes=(7,), expert_rows="per_row")
    assert invariance.guaranteed and model._lockstep_setting.expert_call_rows == 0
    assert "MoE experts: per row (asked for)" in invariance.reason
    with pytest.raises(ValueError, match="expert_rows"):
        set_batch_invariant_limit(model, 4, "rowwise", expert_rows="sorted")
    set_batch_invariant_limit(model, 0)


def test_the_proof_is_kept_per_machine_and_not_reused_under_another_gather(tmp_path):
    model = _tiny_moe()
    proofs = ProofCache(VerdictCache("selftest", tmp_path), {"weights": "tiny qwen3_moe"})
    first = expert_rows.prove_one_call(model, 8, proof_cache=proofs)
    again = expert_rows.prove_one_call(model, 8, proof_cache=proofs)
    assert (first.one_call_rows, first.cached, again.one_call_rows, again.cached) == (8, False, 8, True)
    with shape_variant_backend():  # other gather ops: a new key, proven again
        variant = expert_rows.prove_one_call(model, 8, proof_cache=proofs)
    assert (variant.one_call_rows, variant.cached) == (0, False)


def test_a_ragged_deterministic_pass_launches_each_projection_once_a_layer(monkeypatch):
    """Ten requests' decode rows in one ragged pass wider than L, as the engine runs
    deterministic decode passes: each expert projection of each layer is one gather call (per
    row: ten), and every request's logits are its solo pass's bits."""
    from mlx_lm.models.cache import make_prompt_cache

    from lockstep.kernels.batching.ragged import enable_ragged, ragged_forward

    model = _tiny_moe()
    invariance = set_batch_invariant_limit(model, 4, "rowwise", prefixes=(7,))
    assert invariance.guaranteed and model._lockstep_setting.expert_call_rows >= 10, invariance.reason
    enable_ragged(model)
    launches = []
    real = mx.gather_mm
    monkeypatch.setattr(mx, "gather_mm", lambda *a, **kw: launches.append(a[0].shape) or real(*a, **kw))
    caches = [make_prompt_cache(model) for _ in range(10)]
    for i, cache in enumerate(caches):
        mx.eval(ragged_forward(model, [(cache, list(range(1, 3 + i)))]))
    solo = [ragged_forward(model, [(copy.deepcopy(cache), [7])])[0] for cache in caches]
    mx.eval(solo)
    launches.clear()
    with calls_in_blocks():
        outs = ragged_forward(model, [(cache, [7]) for cache in caches])
    mx.eval(outs)
    assert len(launches) == 3 * len(model.layers)  # gate, up and down, once a layer
    assert all(bits_equal(out, alone) for out, alone in zip(outs, solo))
    set_batch_invariant_limit(model, 0)
