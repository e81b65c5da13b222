"""kernels/audit/: the real CPU nvfp4 lookup failure, the faulty-kernel double, refusal."""
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_unflatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model as mlx_load_model

from lockstep.kernels.audit import apply_workarounds, audit_model, format_table, summary, workarounds
from lockstep.kernels.audit.patch import quantized_layers
from lockstep.kernels.audit.probes import layer_kind, reference_weight
from lockstep.kernels.audit.reference import reference_dequantize
from tests.doubles.faulty_kernels import faulty_tiled_qmm
from lockstep.models.errors import ModelError
from tests.synthetic import build_llama_dir, write_tiny_tokenizer

# Logits of the patched nvfp4 model vs its float32 dequantized twin, relative to the
# largest logit. Measured ~1e-6 (float32 accumulation order only); a wrong kernel or a
# wrong padding gives >1e-2.
LOGIT_TOL = 1e-4
PROMPT_LENGTHS = (1, 2, 7, 40)  # odd and even; 40 rows reach the tiled path (>= 33)


@pytest.fixture(scope="module")
def nvfp4_dir(tmp_path_factory):
    path = build_llama_dir(tmp_path_factory.mktemp("nvfp4"), q_mode="nvfp4")
    write_tiny_tokenizer(path)  # only `lockstep audit` (models.load) needs it
    return path


def load(path):
    return mlx_load_model(path)[0]


def dequantized_twin(path) -> nn.Module:
    """The same model with every quantized layer replaced by its float32 NumPy decode."""
    model = load(path)
    swaps = [(p, workarounds.dequantized(m, layer_kind(m), reference_weight(m)))
             for p, m in model.named_modules() if layer_kind(m) is not None]
    model.update_modules(tree_unflatten(swaps))
    return model


def prompt(n: int) -> mx.array:
    return mx.array([[(7 * i + 3) % 384 for i in range(n)]])


def rel_err(a: mx.array, b: mx.array) -> float:
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


def decode_logits(model, n_prompt: int, steps: int = 2) -> mx.array:
    cache = make_prompt_cache(model)
    model(prompt(n_prompt), cache=cache)
    outs = [model(mx.array([[11 + s]]), cache=cache) for s in range(steps)]
    return mx.concatenate(outs, axis=1)


@pytest.fixture(scope="module")
def reference(nvfp4_dir):
    return dequantized_twin(nvfp4_dir)


def test_reference_decoder_matches_mlx_dequantize():
    w = mx.random.normal((64, 256), key=mx.random.key(1)) * 0.05
    for mode, bits, group in [("affine", 4, 64), ("affine", 8, 32), ("mxfp4", 4, 32),
                              ("mxfp8", 8, 32), ("nvfp4", 4, 16)]:
        q = mx.quantize(w, group, bits, mode=mode)
        biases = q[2] if len(q) > 2 else None
        ours = reference_dequantize(q[0], q[1], biases, mode, bits, group)
        theirs = mx.dequantize(q[0], q[1], biases, group_size=group, bits=bits, mode=mode,
                               dtype=mx.float32)
        np.testing.assert_array_equal(ours, np.array(theirs), err_msg=mode)


def test_cpu_odd_row_lookup_really_fails(nvfp4_dir):
    with pytest.raises(ValueError, match="reshape"):
        mx.eval(load(nvfp4_dir)(prompt(1)))


def test_audit_catches_real_lookup_failure_and_routes_around_it(nvfp4_dir, reference):
    model = load(nvfp4_dir)
    report = audit_model(model)
    embed = next(c for c in report.configs if c.config.kind == "embedding")
    assert embed.verdict == "pad32"
    assert {p.rows for p in embed.failing} == {1, 3, 23}  # odd row counts only
    assert all("reshape" in p.exception for p in embed.failing)
    assert all(c.verdict == "ok" for c in report.configs if c.config.kind == "linear")
    assert apply_workarounds(model, report) == ["model.embed_tokens"]

    for n in PROMPT_LENGTHS:
        assert rel_err(model(prompt(n)), reference(prompt(n))) < LOGIT_TOL, n
    assert rel_err(decode_logits(model, 3), decode_logits(reference, 3)) < LOGIT_TOL


def test_faulty_tiled_kernel_caught_and_worked_around(nvfp4_dir, reference):
    with faulty_tiled_qmm():
        unpatched = load(nvfp4_dir)
        apply_workarounds(unpatched, audit_model(unpatched, prompt_rows=40))
        # Negative control: the embedding fix alone leaves the faulty tiled matmuls.
        unpatched_for_control = load(nvfp4_dir)
        report_control = audit_model(unpatched_for_control)
        embed_only = [c for c in report_control.configs if c.config.kind == "embedding"]
        report_control.configs = embed_only
        apply_workarounds(unpatched_for_control, report_control)
        assert rel_err(unpatched_for_control(prompt(40)), reference(prompt(40))) > 1e-2
        assert rel_err(unpatched_for_control(prompt(8)), reference(prompt(8))) < LOGIT_TOL

        model = load(nvfp4_dir)
        report = audit_model(model)
        for c in report.configs:
            assert c.verdict == "pad32", c.config.label()
            assert {p.rows for p in c.failing if p.path.startswith(("matmul", "as_linear"))} \
                >= {33, 64}
            assert all(p.ok for p in c.paths if p.rows == 1 and "matmul" in p.path)
        apply_workarounds(model, report)
        for n in PROMPT_LENGTHS:
            assert rel_err(model(prompt(n)), reference(prompt(n))) < LOGIT_TOL, n
        assert rel_err(decode_logits(model, 40), decode_logits(reference, 40)) < LOGIT_TOL
    table = format_table(report)
    assert "pad32" in table and "FAIL" in table and "linear 2064x1040 nvfp4" in table
    info = summary(report)
    assert info["refused"] == [] and len(info["workarounds"]) == 5
    assert info["max_error"] < 1e-3


def test_a_workaround_that_fixes_only_some_paths_is_never_the_verdict(nvfp4_dir, monkeypatch):
    # pad32 fixes the embedding's odd-row lookups (the real CPU failure) but not the tiled
    # matmuls, which this fault breaks at every width: the verdict is the next workaround
    # that fixes every path, or a refusal when there is none
    with faulty_tiled_qmm(any_width=True):
        report = audit_model(load(nvfp4_dir), prompt_rows=40)
        for c in report.configs:
            pad32 = dict(c.attempts)["pad32"]
            still_failing = {p.path for p in pad32 if not p.ok}
            assert still_failing and all("tiled" in p or "prompt" in p for p in still_failing), c.config.label()
            assert any(p.ok for p in pad32), c.config.label()  # a partial fix, not a total failure
            assert c.verdict == "dequantized", c.config.label()
            assert all(p.ok for p in c.accepted)
        embed = next(c for c in report.configs if c.config.kind == "embedding")
        fixed = {p.path for p in dict(embed.attempts)["pad32"] if p.ok} & {p.path for p in embed.failing}
        assert {"lookup odd"} <= fixed

        monkeypatch.setattr(workarounds, "WORKAROUNDS", ("pad32",))
        model = load(nvfp4_dir)
        report = audit_model(model, prompt_rows=40)
        assert {c.verdict for c in report.configs} == {"refused"}
        with pytest.raises(ModelError, match="no workaround passed"):
            apply_workarounds(model, report)


def test_refuses_when_no_workaround_passes(nvfp4_dir, monkeypatch):
    monkeypatch.setattr(workarounds, "WORKAROUNDS", ("pad32",))
    real = mx.quantized_matmul
    monkeypatch.setattr(mx, "quantized_matmul", lambda *a, **k: real(*a, **k) * 2.0)
    model = load(nvfp4_dir)
    report = audit_model(model, prompt_rows=40)
    assert not report.ok
    with pytest.raises(ModelError, match=r"layer model\.\S+ .*matmul decode rows=1"):
        apply_workarounds(model, report)


def test_switch_layer_gather_paths_audited():
    from mlx_lm.models.switch_layers import SwitchLinear

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = SwitchLinear(1040, 64, 4, bias=False).to_quantized(16, 4, "nvfp4")

    model = Experts()
    report = audit_model(model, prompt_rows=40)
    (config,) = report.configs
    assert config.config.kind == "switch" and config.config.shape == (4, 64, 1040)
    assert [p.path for p in config.paths][:2] == ["gather decode", "gather short"]
    assert config.verdict != "refused"
    assert len(quantized_layers(model)) == 1


def test_cli_audit_prints_table(nvfp4_dir, capsys):
    from lockstep.server.cli import main as cli_main

    assert cli_main(["audit", str(nvfp4_dir), "--prompt-rows", "40"]) == 0
    out = capsys.readouterr().out
    assert "embedding 384x1040 nvfp4" in out and "pad32" in out and "lookup odd" in out


def test_the_lookup_probes_give_int32_ids_as_a_prompts_tokens_reach_the_model(tmp_path, monkeypatch):
    """The served lookups gather by int32 ids (and on CUDA each index dtype is a kernel of its
    own, compiled at first use): the audit probes those, not int64 ones; its row sample's
    reference takes its rows by int32 indices too."""
    seen, taken = [], []
    real, real_take = nn.QuantizedEmbedding.__call__, mx.take
    monkeypatch.setattr(nn.QuantizedEmbedding, "__call__", lambda self, x: seen.append(x.dtype) or real(self, x))
    model = load(build_llama_dir(tmp_path, q_mode="affine", hidden=256, intermediate=512, heads=4, kv_heads=2))
    audit_model(model, fresh=True)
    assert seen and set(seen) == {mx.int32}
    seen.clear()
    model(mx.array([[5, 6, 7]]), cache=make_prompt_cache(model))
    assert set(seen) == {mx.int32}  # what a prompt's tokens are
    monkeypatch.setattr(mx, "take", lambda a, index, **k: taken.append(index.dtype) or real_take(a, index, **k))
    rows = np.array([0, 5, 9])
    assert reference_weight(model.model.embed_tokens, rows).shape[0] == 3
    assert taken and set(taken) == {mx.int32}


def test_a_layer_lockstep_swapped_is_probed_as_mlx_runs_it():
    """At L = 0 on CUDA the deferred audit stages run after `install_plain_kernels` gave the
    large 4-bit layers lockstep's class: the probes, of a slice of a layer's rows above all,
    must run MLX's call, never the swapped layer's launch, which is sized for the whole layer
    (on an H100 it read past a slice's weight: an illegal memory access that ended the engine)."""
    from lockstep.kernels.invariance.layers import InvariantQuantizedLinear

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.QuantizedLinear.from_linear(nn.Linear(256, 160, bias=False), 32, 4)

    launched = []

    class WholeLayerLaunch:  # in place of ops.SplitRows: its output has the whole layer's columns
        def __call__(self, layer, x, canonical=False):
            launched.append(layer["weight"].shape[0])
            return mx.zeros((*x.shape[:-1], 160), x.dtype)

    model = Model()
    model.proj.__class__ = InvariantQuantizedLinear
    model.proj._split_rows = WholeLayerLaunch()
    report = audit_model(model, fresh=True)
    assert launched == []
    assert report.ok and [c.verdict for c in report.configs] == ["ok"]
    assert type(model.proj) is InvariantQuantizedLinear  # the served layer keeps its class
