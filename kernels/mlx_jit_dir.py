"""Where MLX's CUDA backend keeps the modules it compiles at run time, as MLX decides it:
`MLX_PTX_CACHE_DIR`, else std::filesystem::temp_directory_path() (TMPDIR, TMP, TEMP, TEMPDIR,
else /tmp) / mlx / MLX's C++ version / ptx (mlx/backend/cuda/jit_module.cpp, `ptx_cache_dir`,
read once, at its first module). Its loader reads `<dir>/<module>.ptx` before compiling: the
audit's children publish their kernels there (audit/compile_ahead.py) and lockstep's
precompiled kernels are launched by name from there (custom/module_files.py)."""
from __future__ import annotations

import os
import re
from pathlib import Path


def mlx_version() -> str:
    """MLX's C++ version string, major.minor.patch (Python's may carry a .dev suffix)."""
    import mlx.core as mx

    match = re.match(r"\d+\.\d+\.\d+", mx.__version__)
    return match.group(0) if match else mx.__version__


def module_dir(environ=os.environ) -> Path:
    """MLX's module directory under `environ` (this process's environment by default)."""
    if environ.get("MLX_PTX_CACHE_DIR"):
        return Path(environ["MLX_PTX_CACHE_DIR"])
    temp = next((environ[v] for v in ("TMPDIR", "TMP", "TEMP", "TEMPDIR") if environ.get(v)), "/tmp")
    return Path(temp) / "mlx" / mlx_version() / "ptx"
