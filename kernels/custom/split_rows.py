"""Which of lockstep's own 4-bit row kernels a call of a layer runs (qmv_mma.py on tensor
cores, qmv_split.py on CUDA cores), from the layer's size, the format, x's dtype, the call's
rows and whether they are canonical. The one place that decides: the layers
(invariance/ops.SplitRows) and the startup compile (precompile.py) both ask it.

- canonical rows (every call a setting makes canonical, one row included): `qmv_mma` where its
  smoke test passed here, else `qmv_split` for large layers; one kernel a layer and dtype, so
  a layer's rows have one order at every width;
- plain calls: one row through `qmv_split` (large layers) or `qmv_mma`; more rows of a large
  layer through `qmv_mma` (of a smaller one, MLX's call is faster);
each where it was fastest on the H200 (docs/BENCHMARKS.md, sessions 16 and 18)."""
from . import qmv_mma, qmv_split


def takes_layer(n: int, k: int, mode: str, bits: int, group: int) -> bool:
    """Whether any of the kernels is for a layer of (N, K) weights of this quantization."""
    return qmv_split.takes(mode, bits, group) and (qmv_split.pays(n, k) or qmv_mma.pays(n, k))


def kernel_for(n: int, k: int, mode: str, dtype, rows: int, canonical: bool):
    """The module (qmv_mma or qmv_split) such a call runs, or None: the layer's own path."""
    large = qmv_split.pays(n, k)
    mma_here = (qmv_mma.pays(n, k) and k % qmv_mma.CHUNK == 0
                and qmv_mma.unavailable_reason(mode, dtype) is None)
    if canonical:
        return qmv_mma if mma_here else qmv_split if large else None
    if rows == 1:
        return qmv_split if large else qmv_mma if mma_here else None
    return (qmv_mma if mma_here else qmv_split) if large else None
