"""Which CPU BLAS MLX's matmuls reach in this process, for choosing a weights format.

On Linux, lockstep's OpenBLAS shim (kernels/cpu_blas.py) is preloaded into the process when
`--cpu-blas openblas` is in force; preloaded objects are in the global symbol scope, so the
marker symbol the shim exports resolves from the process itself. (Merely mapped, e.g.
dlopen'd late, it would not interpose MLX's calls, and the marker would not resolve.)
"""
from __future__ import annotations

import ctypes
import sys

SHIM_MARKER = "lockstep_cpu_blas_shim"  # exported by kernels/cpu_blas/shim.c


def cpu_blas_in_use() -> str:
    """"openblas" (the shim interposes), "reference" (MLX's bundled BLAS) or "accelerate" (macOS)."""
    if sys.platform == "darwin":
        return "accelerate"
    try:
        ctypes.c_char.in_dll(ctypes.CDLL(None), SHIM_MARKER)
    except (ValueError, OSError):
        return "reference"
    return "openblas"
