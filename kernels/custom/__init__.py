"""Custom batch-invariant kernels through MLX's public custom-kernel API
(mx.fast.cuda_kernel / mx.fast.metal_kernel; on CUDA each instance compiled once per machine
and launched with mx.fast.precompiled_cuda_kernel: compiled.py, precompile.py). Sources live
beside this file as .cu / .metal; loop_order.py is the NumPy model of their reduction order."""
from . import gemv_rows, mma_rows, qmv_mma, qmv_rows, qmv_split, split_rows
from .loop_order import MAX_ROWS
from .skinny import (
    available,
    backend,
    dense_matmul,
    dense_one_launch,
    dense_serves,
    quantized_kind,
    quantized_matmul,
    quantized_serves,
    unavailable_reason,
    uses_mma,
)

__all__ = ["MAX_ROWS", "gemv_rows", "mma_rows", "qmv_mma", "qmv_rows", "qmv_split", "split_rows", "available", "backend", "dense_matmul", "dense_one_launch", "dense_serves", "quantized_kind",
           "quantized_matmul", "quantized_serves", "unavailable_reason", "uses_mma"]
