"""models/fused_projections.py: q/k/v and gate/up as one matmul each (`serve --fuse-projections`).

The fused model computes what the separate layers computed (bit for bit with MLX's quantized
kernels and, dense, on the reference BLAS; within float32 rounding on OpenBLAS, whose float32
kernels block by N), holds no weight twice, dispatches fewer ops per decode step, and proves its
batch invariance like any model: the self-test passes under the shape-variant double, and the
deterministic rows of a fused model equal their single-row calls.
"""
import re
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from lockstep.kernels.invariance import set_batch_invariant_limit
from lockstep.kernels.invariance.selftest import bits_equal, self_test
from lockstep.models.fused_projections import ProjectionPart, fuse_projections
from tests.doubles.shape_variant import shape_variant_backend
from tiny_models import QUANT_MODES, tiny_llama

TOKENS = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])


def pair(quant=None, **kw):
    """(separate, fused) copies of one tiny model."""
    dtype = mx.bfloat16 if quant in ("nvfp4", "mxfp4", "mxfp8") else mx.float32
    separate, fused = tiny_llama(quant=quant, dtype=dtype, **kw), tiny_llama(quant=quant, dtype=dtype, **kw)
    return separate, fused, fuse_projections(fused)


def prefill_and_decode(model):
    cache = make_prompt_cache(model)
    prompt = model(TOKENS, cache=cache)
    return prompt, model(mx.array([[7]]), cache=cache)


@pytest.mark.parametrize("quant", sorted(QUANT_MODES))
def test_the_fused_quantized_model_computes_what_the_separate_layers_did(quant):
    separate, fused, paths = pair(quant)
    assert len(paths) == 4  # two layers: fused_qkv and fused_gate_up each
    for a, b in zip(prefill_and_decode(separate), prefill_and_decode(fused)):
        assert bits_equal(a, b)


def test_the_fused_dense_model_computes_what_the_separate_layers_did():
    separate, fused, _ = pair()
    for a, b in zip(prefill_and_decode(separate), prefill_and_decode(fused)):
        assert mx.allclose(a, b, rtol=1e-5, atol=1e-5).item()


@pytest.mark.reference_blas
def test_on_the_reference_blas_the_fused_dense_model_is_bit_identical():
    separate, fused, _ = pair()
    for a, b in zip(prefill_and_decode(separate), prefill_and_decode(fused)):
        assert bits_equal(a, b)


def test_no_weight_is_held_twice_and_the_parts_hold_none():
    separate, fused, _ = pair("affine")
    names = [k for k, _ in tree_flatten(fused.parameters())]
    assert not any(re.search(r"\.(q|k|v|gate|up)_proj\.", n) for n in names)
    assert any(n.endswith("self_attn.fused_qkv.weight") for n in names)
    assert any(n.endswith("mlp.fused_gate_up.scales") for n in names)
    size = lambda m: sum(v.nbytes for _, v in tree_flatten(m.parameters()))  # noqa: E731
    assert size(fused) == size(separate)
    attn = fused.model.layers[0].self_attn
    assert isinstance(attn.q_proj, ProjectionPart) and not isinstance(attn.q_proj, nn.Module)
    assert attn.fused_qkv.weight.shape[0] == sum(
        getattr(separate.model.layers[0].self_attn, p).weight.shape[0] for p in ("q_proj", "k_proj", "v_proj"))


def test_only_layers_that_agree_are_fused():
    model = tiny_llama(quant="affine")
    mlp = model.model.layers[0].mlp
    mlp.up_proj = nn.Linear(128, 256, bias=False)  # one part dense, the other quantized
    paths = fuse_projections(model)
    assert not any("layers.0.mlp" in p for p in paths) and any("layers.1.mlp" in p for p in paths)
    assert isinstance(mlp.gate_proj, nn.QuantizedLinear)  # left as it was


def _ops(*outputs) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        names = re.findall(r'\[label ="([^"]+)", shape=rectangle\]', Path(f.name).read_text())
    return {n: names.count(n) for n in set(names)}


def test_a_decode_step_dispatches_three_fewer_matmuls_per_layer():
    counts = []
    for model in pair()[:2]:
        cache = make_prompt_cache(model)
        mx.eval(model(TOKENS, cache=cache))
        counts.append(_ops(model(mx.array([[7]]), cache=cache)))
    separate, fused = counts
    layers = 2
    assert separate["Matmul"] - fused["Matmul"] == 3 * layers
    assert sum(fused.values()) < sum(separate.values())


def test_a_fused_model_is_proven_and_its_rows_keep_their_single_row_bits():
    _, model, _ = pair()
    with shape_variant_backend():
        invariance = set_batch_invariant_limit(model, 4, prefixes=(7,))
        assert invariance.guaranteed and invariance.strategy != "native"
        assert self_test(model, 4, prefixes=(7,)).passed
        set_batch_invariant_limit(model, 0)
        unproven = set_batch_invariant_limit(model, 4, "native", prefixes=(7,))
        assert not unproven.guaranteed  # the negative control: native rows change with M here


def test_serve_fuses_before_the_audit_and_names_it_in_the_fingerprinted_transform(monkeypatch):
    import lockstep.kernels.audit as audit
    from lockstep.server.runtime import Options, build_runtime

    seen = []
    real = audit.audit_and_patch

    def spy(model, **kwargs):
        seen.append([name for name, _ in tree_flatten(model.parameters())])
        return real(model, **kwargs)

    monkeypatch.setattr(audit, "audit_and_patch", spy)
    runtime = build_runtime(Options(quantize="affine", fuse_projections=True))
    assert seen and any(n.endswith("self_attn.fused_qkv.weight") for n in seen[0])  # audited fused
    assert "fused_projections" in runtime.transform


def test_fusing_refuses_distributed_sharding():
    from lockstep.server.runtime import Options, build_runtime

    with pytest.raises(ValueError, match="distributed"):
        build_runtime(Options(fuse_projections=True, prepare_model=lambda model: "sharded"))
