"""kernels/audit/row_sample.py: a probe on the whole of a large layer compares (and its reference
decodes) a fixed sample of the output rows; a fault in rows the full check saw is still caught,
and the verdicts under the faulty-kernel doubles are those of comparing every row."""
import contextlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.utils import load_model as mlx_load_model

import lockstep.kernels.audit.patch as audit
from lockstep.kernels.audit import audit_model, format_table, probes
from lockstep.kernels.audit.row_sample import BLOCK_ROWS, EDGE_ROWS, WHOLE_BELOW, compared_rows
from lockstep.kernels.audit.slicing import CUDA_SM90_QMV_MAX_N
from tests.doubles.faulty_kernels import faulty_tiled_qmm
from tests.synthetic import build_llama_dir

PROMPT_ROWS = 40
# A head past CUDA's qmv bound (its decode probe runs on the whole layer there), 16 mod 32 rows.
HEAD_ROWS = CUDA_SM90_QMV_MAX_N + 48
K = 64  # a multiple of 32: pad32 does not apply, a faulty kernel's workaround is `dequantized`


class Head(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        mx.random.seed(5)
        dense = nn.Linear(K, HEAD_ROWS, bias=True) if kind == "linear" else nn.Embedding(HEAD_ROWS, K)
        self.head = dense.to_quantized(group_size=16, bits=4, mode="nvfp4")


def outcome(report) -> list:
    return [(c.config, c.verdict, sorted((p.path, p.rows) for p in c.failing),
             [name for name, _ in c.attempts]) for c in report.configs]


@contextlib.contextmanager
def faulty_rows(rows_of):
    """`mx.quantized_matmul` wrong (or NaN) in the output rows `rows_of(n)` of a whole
    `HEAD_ROWS`-row layer only: a fault no slice of the layer shows."""
    real = mx.quantized_matmul

    def quantized_matmul(x, w, *args, **kwargs):
        y = real(x, w, *args, **kwargs)
        if y.shape[-1] != HEAD_ROWS:
            return y
        bad, value = rows_of(HEAD_ROWS)
        mask = np.zeros(HEAD_ROWS, dtype=bool)
        mask[bad] = True
        return mx.where(mx.array(mask), mx.array(value, dtype=y.dtype), y)
    quantized_matmul.faulty = True
    mx.quantized_matmul = quantized_matmul
    try:
        yield
    finally:
        mx.quantized_matmul = real


def _first_row_not_compared(n):
    return int(np.setdiff1d(np.arange(n), compared_rows(n))[0])


FAULTS = {
    "last row of the vocabulary": lambda n: ([n - 1], 1e3),
    "the 16-row tail group": lambda n: (np.arange(n - 16, n), 1e3),
    "rows 16 mod 32 throughout": lambda n: (np.arange(n)[np.arange(n) % 32 >= 16], 1e3),
    "a NaN in a row not compared": lambda n: ([_first_row_not_compared(n)], np.nan),
}


def test_the_sample_keeps_both_ends_every_block_and_every_residue():
    n = 128256
    rows = compared_rows(n)
    assert np.all(np.diff(rows) > 0) and rows[0] == 0 and rows[-1] == n - 1
    assert set(range(EDGE_ROWS)) | set(range(n - EDGE_ROWS, n)) <= set(rows.tolist())
    assert set((rows // BLOCK_ROWS).tolist()) == set(range(n // BLOCK_ROWS))  # every 32-row block
    middle = rows[(rows >= EDGE_ROWS) & (rows < n - EDGE_ROWS)]
    assert set((middle % 32).tolist()) == set(range(32))  # 16 mod 32 among them, not only at the ends
    assert len(rows) < n / 25
    assert compared_rows(WHOLE_BELOW - 1) is None and len(compared_rows(WHOLE_BELOW)) < WHOLE_BELOW


@pytest.fixture
def on_cuda(monkeypatch):
    """The audit slices as on CUDA (the kernels still run here)."""
    monkeypatch.setattr(audit, "backend_kind", lambda: "cuda")


@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_a_whole_layer_probe_decodes_only_the_compared_rows(kind, on_cuda, monkeypatch):
    decoded = []
    real = probes.reference_dequantize
    monkeypatch.setattr(probes, "reference_dequantize",
                        lambda w, *a, **k: decoded.append(w.shape[0]) or real(w, *a, **k))
    report = audit_model(Head(kind), prompt_rows=PROMPT_ROWS)
    (config,) = report.configs
    assert config.verdict == "ok"
    decode = next(p for p in config.paths if p.rows == 1 and "lookup" not in p.path)
    sample = len(compared_rows(HEAD_ROWS))
    assert (decode.out_rows, decode.compared_rows) == (HEAD_ROWS, sample)
    assert max(decoded) == sample < HEAD_ROWS  # never the whole weight
    assert f"{HEAD_ROWS} ({sample} compared)" in format_table(report)


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_a_fault_only_the_whole_layer_shows_is_caught_by_the_sample(kind, fault, on_cuda):
    path = "matmul decode" if kind == "linear" else "as_linear decode"
    with faulty_rows(FAULTS[fault]):
        (config,) = audit_model(Head(kind), prompt_rows=PROMPT_ROWS).configs
    assert [(p.path, p.rows) for p in config.failing] == [(path, 1)]
    assert config.verdict == "dequantized" and all(p.ok for p in config.accepted)


@pytest.fixture(scope="module")
def nvfp4_dir(tmp_path_factory):
    return build_llama_dir(tmp_path_factory.mktemp("nvfp4"), q_mode="nvfp4")


@pytest.mark.parametrize("double", ["none (the real CPU lookup fault)", "tiled 16 mod 32",
                                    "tiled at any width (pad32 a partial fix)"])
def test_same_verdicts_as_comparing_every_row_under_the_faulty_doubles(nvfp4_dir, double,
                                                                        monkeypatch):
    # Metal's slicing: every matmul path also runs on the whole layer, so every layer of
    # 1024 rows or more is compared on its sample.
    monkeypatch.setattr(audit, "backend_kind", lambda: "metal")
    fault = {"tiled 16 mod 32": faulty_tiled_qmm,
             "tiled at any width (pad32 a partial fix)": lambda: faulty_tiled_qmm(any_width=True)}
    with fault.get(double, contextlib.nullcontext)():
        sampled = audit_model(mlx_load_model(nvfp4_dir)[0], prompt_rows=PROMPT_ROWS)
        with monkeypatch.context() as m:
            m.setattr(audit, "compared_rows", lambda n: None)
            every_row = audit_model(mlx_load_model(nvfp4_dir)[0], prompt_rows=PROMPT_ROWS)
    assert any(p.compared_rows for c in sampled.configs for p in c.paths)
    assert outcome(sampled) == outcome(every_row)
    assert any(c.verdict != "ok" for c in sampled.configs)


def test_a_switch_layer_compares_its_sample_on_every_expert(monkeypatch):
    from mlx_lm.models.switch_layers import SwitchLinear

    experts, n = 4, WHOLE_BELOW + 16

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            mx.random.seed(7)
            self.experts = SwitchLinear(K, n, experts, bias=True).to_quantized(16, 4, "nvfp4")

    # Metal's slicing: every gather path runs on the whole layer only (its kernel choice
    # depends on N there), so each is compared on the sample.
    monkeypatch.setattr(audit, "backend_kind", lambda: "metal")
    decoded = []
    real_decode = probes.reference_dequantize
    monkeypatch.setattr(probes, "reference_dequantize",
                        lambda w, *a, **k: decoded.append(w.shape) or real_decode(w, *a, **k))
    (config,) = audit_model(Experts(), prompt_rows=PROMPT_ROWS).configs
    sample = len(compared_rows(n))
    assert config.verdict == "ok" and len(config.paths) == 4
    assert {(p.out_rows, p.compared_rows) for p in config.paths} == {(n, sample)}
    assert decoded == [(experts, sample, K * 4 // 32)]  # the sample's rows of every expert

    real = mx.gather_qmm

    def last_row_of_last_expert_wrong(*args, rhs_indices, **kwargs):
        y = real(*args, rhs_indices=rhs_indices, **kwargs)
        if y.shape[-1] != n:
            return y
        hit = mx.expand_dims(rhs_indices == experts - 1, -1)  # beside y's one-row axis
        return y.at[..., -1].add(mx.where(hit, 1e3, 0.0).astype(y.dtype))
    monkeypatch.setattr(mx, "gather_qmm", last_row_of_last_expert_wrong)
    (config,) = audit_model(Experts(), prompt_rows=PROMPT_ROWS).configs
    # every gather path routes the last expert, and its last row is in the sample
    assert [p.path for p in config.failing] == [p.path for p in config.paths]
    assert all(p.compared_rows == sample for p in config.failing)
    assert config.verdict == "dequantized" and all(p.ok for p in config.accepted)


def test_the_compared_rows_are_picked_on_the_host_not_by_a_device_gather(monkeypatch):
    """On CUDA a gather of a layer's output would be a kernel of the output's dtype that serving
    never takes, compiled (seconds) for the audit alone on a fresh start."""
    from lockstep.kernels.audit.probes import _compared_part

    out = mx.arange(24, dtype=mx.float16).reshape(2, 12)
    rows = np.array([0, 5, 11])

    def no_gather(*args, **kwargs):
        raise AssertionError("a device gather")
    monkeypatch.setattr(mx, "take", no_gather)
    got = _compared_part(out, rows)
    assert got.dtype == np.float32 and np.array_equal(got, np.array(out.astype(mx.float32))[:, rows])
