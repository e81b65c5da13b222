"""kernels/invariance/sibling_rows.py on a CPU, with a stand-in for the group launch
(custom/qmv_mma_parts.py runs on CUDA only): which layers form groups, that the first sibling
called runs one launch for its group and each sibling gets its own part of it, which groups
and calls take the launch (canonical calls at every width, plain calls of a few rows), that the
startup self-test proves (or refuses) the launch like any other form, and that uninstalling
gives the layers back. The launch's GPU agreement (each
part equal to its layer's own qmv_mma call, bit for bit) is its smoke test's."""
import mlx.core as mx
import mlx.nn as nn
import pytest

from lockstep.kernels.custom import qmv_mma_parts, qmv_split, split_rows
from lockstep.kernels.custom.precompile import instances_for, linear_shapes
from lockstep.kernels.invariance import layers, set_batch_invariant_limit
from lockstep.kernels.invariance.layers import batch_invariant, native_forms
from lockstep.kernels.invariance.selftest import bits_equal
from lockstep.kernels.invariance.sibling_rows import SiblingRows
from tests.doubles import gemv_rows_alone
from tests.doubles.shape_variant import shape_variant_backend
from tests.test_qmv_rows import rand
from tests.test_qmv_split import split  # noqa: F401 (a fixture)
from tiny_models import tiny_llama


def rows_alone(x, w, scales, biases, **kw):
    """A row-independent stand-in for one part: each row its own call, then halved (so a
    result that went through the group is told apart from the layer's own call)."""
    return mx.concatenate([mx.quantized_matmul(x[i : i + 1], w, scales, biases, transpose=True, **kw)
                           for i in range(x.shape[0])], axis=0) * 0.5


def one_call(x, w, scales, biases, **kw):
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, **kw) * 0.5


@pytest.fixture
def group_launch(monkeypatch):
    """Every q/k/v and gate/up group of a tiny model runs through a stand-in launch the test
    gives; each launch's (rows, parts' widths) is recorded."""
    calls = []
    gemv_rows_alone.emulate(monkeypatch)  # the dense layers: rows alone

    def use(kernel):
        class StandIn:
            @staticmethod
            def launch_for(lead, ns, k, mode, bits, group, *_):
                def launch(x, *arrays):
                    rows = x.reshape(-1, k)
                    calls.append((rows.shape[0], ns))
                    per = 3 if mode == "affine" else 2
                    parts = [arrays[i : i + per] for i in range(0, len(arrays), per)]
                    return [kernel(rows, p[0], p[1], p[2] if per == 3 else None, group_size=group, bits=bits,
                                   mode=mode).reshape(*lead, n) for p, n in zip(parts, ns)]
                return launch

        monkeypatch.setattr(split_rows, "parts_kernel_for", lambda *_: StandIn)
        return calls
    return use


def parts(model):
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    return (attention.q_proj, attention.k_proj, attention.v_proj), (mlp.gate_proj, mlp.up_proj)


def own(layer, x):
    kw = dict(group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
    y = rows_alone(x, layer["weight"], layer["scales"], layer.get("biases"), **kw)
    return y + layer["bias"] if "bias" in layer else y


@pytest.fixture
def plain_kernels(monkeypatch):
    monkeypatch.setattr(qmv_split, "runs_here", lambda: True)  # as on CUDA: plain kernels installed at L = 0


@pytest.mark.parametrize("quant", ["nvfp4", "affine"])
def test_siblings_share_one_launch_and_each_gets_its_own_part(group_launch, plain_kernels, quant):
    calls = group_launch(rows_alone)
    model = tiny_llama(quant=quant, dtype=mx.bfloat16, bias=True)
    invariance = set_batch_invariant_limit(model, 0)
    assert invariance.layers["sibling_groups"] == 2 * len(model.model.layers)
    qkv, gate_up = parts(model)
    assert isinstance(qkv[0]._siblings, SiblingRows) and all(p._siblings is qkv[0]._siblings for p in qkv)
    assert all(p._siblings is gate_up[0]._siblings for p in gate_up) and qkv[0]._siblings is not gate_up[0]._siblings
    x = rand(3, 128, seed=3, dtype=mx.bfloat16)
    for group in (qkv, gate_up):
        calls.clear()
        got = [layer(x) for layer in group]
        assert calls == [(3, tuple(layer.weight.shape[0] for layer in group))]  # one launch, all parts
        for layer, y in zip(group, got):
            assert bits_equal(y, own(layer, x))
    calls.clear()
    mx.eval(model(mx.array([[5, 6]]), cache=None))
    assert len(calls) == 2 * len(model.model.layers)  # one launch an attention block, one an MLP
    set_batch_invariant_limit(model, 0)


def plain_model():
    """A tiny nvfp4 model as L = 0 installs it, and its first attention block's q, k and v."""
    model = tiny_llama(quant="nvfp4", dtype=mx.bfloat16)
    set_batch_invariant_limit(model, 0)
    return model, parts(model)[0]


def test_a_part_taken_twice_or_a_new_x_runs_the_launch_again(group_launch, plain_kernels):
    calls = group_launch(rows_alone)
    _, (q, k, v) = plain_model()
    x, other = rand(2, 128, seed=4, dtype=mx.bfloat16), rand(2, 128, seed=5, dtype=mx.bfloat16)
    calls.clear()
    q(x), q(x)
    assert len(calls) == 2
    calls.clear()
    q(x), k(x), k(x)  # k's part is handed out once
    assert len(calls) == 2
    calls.clear()
    first = q(other)
    second = k(x)  # another x: its own launch, not q's x's part
    assert len(calls) == 2 and bits_equal(second, own(k, x)) and bits_equal(first, own(q, other))


def test_canonical_calls_of_any_width_and_plain_calls_of_a_few_take_the_launch(group_launch, plain_kernels):
    calls = group_launch(rows_alone)
    model, (q, k, v) = plain_model()
    kw = dict(group_size=q.group_size, bits=q.bits, mode=q.mode)

    def mlx(layer, x):
        return mx.quantized_matmul(x, layer["weight"], layer["scales"], None, transpose=True, **kw)

    few = rand(split_rows.PLAIN_ROWS, 128, seed=6, dtype=mx.bfloat16)
    calls.clear()
    assert bits_equal(k(few), own(k, few)) and len(calls) == 1  # plain rows of a few: the group's launch
    for rows in (1, split_rows.PLAIN_ROWS + 1):  # one plain row, a wide plain call: the layer's own
        x = rand(rows, 128, seed=rows, dtype=mx.bfloat16)
        calls.clear()
        assert bits_equal(k(x), mlx(k, x)) and calls == []
    set_batch_invariant_limit(model, 4, "gemv_rows", prefixes=(7,))
    with native_forms():  # a plain pass of a deployment with L > 0: as at L = 0
        calls.clear()
        assert bits_equal(v(few[:2]), own(v, few[:2])) and len(calls) == 1
    for rows, through in ((1, True), (3, True), (9, False)):  # canonical rows, and a prompt chunk
        x = rand(rows, 128, seed=rows, dtype=mx.bfloat16)
        calls.clear()
        with batch_invariant(model._lockstep_setting):
            y = q(x)
        assert (calls == [(rows, (128, 64, 64))]) == through, (rows, calls)
        assert bits_equal(y, own(q, x) if through else mlx(q, x))
    set_batch_invariant_limit(model, 0)
    layers.uninstall(model)
    assert type(q) is nn.QuantizedLinear and "_siblings" not in q.__dict__


def test_a_group_launch_whose_rows_depend_on_the_width_is_refused(group_launch, split):
    with shape_variant_backend(quantized_rows=2):  # a quantized call of 2+ rows varies here
        split(rows_alone)  # the other 4-bit layers (down, head): rows alone
        group_launch(rows_alone)
        model = tiny_llama(quant="nvfp4", dtype=mx.bfloat16)
        invariance = set_batch_invariant_limit(model, 4, "gemv_rows", prefixes=(7,))
        assert invariance.guaranteed, invariance.reason
        group_launch(one_call)  # all rows in one call: their bits depend on the width
        model = tiny_llama(quant="nvfp4", dtype=mx.bfloat16)
        invariance = set_batch_invariant_limit(model, 4, "gemv_rows", prefixes=(7,))
        assert not invariance.guaranteed and "self-test failed" in invariance.reason


def test_groups_take_the_launch_only_where_every_part_runs_qmv_mma_alone(monkeypatch):
    monkeypatch.setattr(qmv_mma_parts, "unavailable_reason", lambda *_: None)  # as where its smoke test passed
    take = split_rows.parts_kernel_for
    assert take((14336, 14336), 4096, "nvfp4", 4, 16, mx.bfloat16) is qmv_mma_parts  # an 8B's gate and up
    assert take((4096, 1024, 1024), 4096, "nvfp4", 4, 16, mx.bfloat16) is None  # its k and v are small
    assert take((4096, 4096, 4096), 4096, "affine", 4, 64, mx.float16) is qmv_mma_parts
    assert take((14336, 14336), 4096, "mxfp8", 8, 32, mx.bfloat16) is None  # not 4-bit
    assert take((14336, 14336), 4000, "nvfp4", 4, 16, mx.bfloat16) is None  # K not in chunks of 128
    assert take((4096, 14336), 4096, "nvfp4", 4, 16, mx.bfloat16) is None  # K split across 8 and 4 warps
    monkeypatch.setattr(qmv_mma_parts, "unavailable_reason", lambda *_: "its smoke test failed")
    assert take((14336, 14336), 4096, "nvfp4", 4, 16, mx.bfloat16) is None


def test_without_a_launch_the_layers_stay_on_their_own(group_launch, plain_kernels, monkeypatch):
    group_launch(rows_alone)
    monkeypatch.setattr(split_rows, "parts_kernel_for", lambda *_: None)  # as on the CPU
    model = tiny_llama(quant="nvfp4", dtype=mx.bfloat16)
    invariance = set_batch_invariant_limit(model, 0)
    assert "sibling_groups" not in invariance.layers and type(parts(model)[0][0]) is nn.QuantizedLinear


def test_groups_are_layers_of_one_parent_quantized_alike():
    model = tiny_llama(quant="nvfp4", dtype=mx.bfloat16)
    groups = split_rows.sibling_groups(model)
    assert len(groups) == 2 * len(model.model.layers)
    assert {tuple(id(layer) for layer in g) for g in groups} >= {tuple(id(layer) for layer in g) for g in parts(model)}
    dense = tiny_llama(dtype=mx.bfloat16)
    assert split_rows.sibling_groups(dense) == []
    mixed = tiny_llama(quant="nvfp4", dtype=mx.bfloat16)
    attention = mixed.model.layers[0].self_attn
    attention.v_proj = nn.QuantizedLinear.from_linear(nn.Linear(128, 64, bias=False), group_size=64, bits=4)
    assert len(split_rows.sibling_groups(mixed)) == 2 * len(mixed.model.layers) - 1  # v quantized otherwise


def test_startup_lists_each_group_launch(group_launch, monkeypatch):
    group_launch(rows_alone)
    model = tiny_llama(quant="nvfp4", dtype=mx.bfloat16)
    shapes = [s for s in linear_shapes(model, dense="none") if s[3] == "qmv_mma_parts"]
    attention = model.model.layers[0].self_attn
    widths = tuple(layer.weight.shape[0] for layer in (attention.q_proj, attention.k_proj, attention.v_proj))
    assert (widths, 128, mx.bfloat16, "qmv_mma_parts", 16, "nvfp4", 4) in shapes and len(shapes) == 2
    monkeypatch.setattr(split_rows, "parts_kernel_for", lambda *_: None)
    assert not [s for s in linear_shapes(model, dense="none") if s[3] == "qmv_mma_parts"]
    monkeypatch.setattr(split_rows, "parts_kernel_for", lambda *_: qmv_mma_parts)
    monkeypatch.setattr(qmv_mma_parts, "instances", lambda m, ns, *_: [("parts", m, ns)])
    compiled = instances_for([(widths, 128, mx.bfloat16, "qmv_mma_parts", 16, "nvfp4", 4)], range(1, 5))
    assert compiled == [("parts", m, widths) for m in (1, 2, 3, 4)]  # one row too: canonical rows take it
