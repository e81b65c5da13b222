"""Probe a quantized layer on a slice of its output rows: audit cost independent of N.

Quantization groups run along K (the input dim), so the first n output rows of a
quantized weight (rows of `weight`, `scales`, `biases`, `bias`) are themselves a valid
quantized weight whose outputs are exactly those rows of the full output. Probing the
slice is the same test as probing the whole layer wherever the kernel MLX picks does not
depend on N. Which choices do depend on N was read from MLX 0.32's dispatch
(`mlx/backend/{cpu,metal,cuda}/.../quantized.cpp`, `cuda/quantized/qmm/qmm.cu`):

CPU (`QuantizedMatmul::eval_cpu`, `GatherQMM::eval_cpu`): one task per call; `_qmm_t`,
  `_qmm_t_simd`, `fp_qmm_t(_simd)` and `fp_qmm` loop over M and N and pick the kernel
  from (mode, bits, group size, dtype, transpose) only. Nothing depends on N.
CUDA (`QuantizedMatmul::eval_gpu`): `supports_qmm_sm90` needs N*4 % 16 == 0 and picks
  qmv over qmm_sm90 only for M == 1 with N <= 16384 and K <= 16384; `supports_qmm_sm80`
  needs N % 128 == 0; qmv/fp_qmv/qmm_naive choose by K, M, dtype and pointer alignment
  (a slice starting at row 0 keeps the alignment). Keeping N mod 128 keeps every choice
  except the sm90 bound, so M = 1 on N > 16384 also runs at full size.
Metal (`QuantizedMatmul::eval_gpu`, `GatherQMM::eval_gpu`): the M at which qmv becomes
  qmm (`get_qmv_batch_limit(K, N)`: buckets N <= 2048, <= 4096, larger), the narrow
  qmv (N >= 4096, nvfp4, M5 Max), qmv_fast (N % 8), the split-K count of `qmm_splitk`
  (512 / (ceil(N/32) * ceil(M/32)) threadgroups) and the aligned tiles (N % 32, N % 64
  for NAX, gather_qmm_rhs N % bn) all depend on N. Every matmul and gather path runs at
  full size there (the GPU makes that cheap); lookups are sliced.
Embedding lookups (`QuantizedEmbedding.__call__`: gather rows, then `dequantize`) see
  only the gathered rows, on every backend: the table's row count never matters.

An unknown backend runs everything matmul-like at full size.
"""
from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn

from ..backend_kind import backend_kind  # noqa: F401 (the audit's backend names)

# The slice keeps N mod this: 128 for CUDA (sm80's N % 128; Metal's N % 32 and N % 64
# divide it); on the CPU nothing depends on N, and 32 + N mod 32 rows keep probes cheap
# (its float16 quantized matmuls are slow: docs/QUANTIZATION.md) while keeping any 16-row tail.
ROW_MODULUS = {"cpu": 32}
DEFAULT_ROW_MODULUS = 128
CUDA_SM90_QMV_MAX_N = 16384


def sliced_rows(n: int, backend: str) -> int:
    """Output rows to probe for a layer of `n` on `backend`: n itself when small, else
    m + n mod m for the backend's modulus m (see ROW_MODULUS)."""
    m = ROW_MODULUS.get(backend, DEFAULT_ROW_MODULUS)
    return n if n < 2 * m else m + n % m


def full_size(path: str, rows: int, n: int, backend: str) -> bool:
    """Whether probe `path` at `rows` rows must run on all `n` output rows on `backend`."""
    if path.startswith("lookup") or sliced_rows(n, backend) == n:
        return False
    if backend == "cpu":
        return False
    if backend == "cuda":
        return path in ("matmul decode", "as_linear decode") and n > CUDA_SM90_QMV_MAX_N
    return True  # metal: see the module doc; unknown GPU: assume the worst


def as_mlx_runs_it(layer: nn.Module) -> nn.Module:
    """`layer` as MLX's own class calls it: a layer whose class lockstep swapped in
    (kernels/invariance/layers.py; at L = 0 the deferred audit stages run after
    `install_plain_kernels`) becomes a shallow copy of the mlx / mlx-lm class it subclasses.
    The audit is of MLX's kernels (lockstep's have their own smoke tests), and a swapped layer's
    launches are sized for the whole layer, never for a slice of its rows."""
    own = next(c for c in type(layer).__mro__ if not c.__module__.startswith("lockstep."))
    if own is type(layer):
        return layer
    clone = copy.copy(layer)
    clone.__class__ = own
    return clone


def sliced_layer(layer: nn.Module, rows: int) -> nn.Module:
    """A shallow copy of a quantized layer holding its first `rows` output rows.

    Works for QuantizedLinear / QuantizedEmbedding (rows on axis 0) and
    QuantizedSwitchLinear (experts first, rows on axis -2); a per-tensor `global_scale`
    is kept whole.
    """
    out_axis = layer["weight"].ndim - 2
    clone = copy.copy(layer)
    for name in ("weight", "scales", "biases", "bias"):
        value = layer.get(name)
        if value is None:
            continue
        axis = out_axis if name != "bias" else value.ndim - 1
        index = [slice(None)] * value.ndim
        index[axis] = slice(0, rows)
        clone[name] = mx.contiguous(value[tuple(index)])
    if isinstance(layer, nn.QuantizedEmbedding):
        clone.num_embeddings = rows
    return clone
