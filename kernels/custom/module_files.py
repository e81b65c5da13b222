"""A precompiled kernel launched by a short name in place of its cubin's bytes.

MLX's CUDA `CustomKernel` names the module it loads (once a process) by hashing its whole
source string, and it does so at every launch: for a precompiled kernel that string is the
cubin, so each launch hashes tens of KB (bench/launch_bytes.py measures what a KB costs). Its
JIT loader reads `<ptx cache dir>/<module name>.ptx` (the image) and `.txt` (kernel names)
before it uses the source at all. So a launch whose source is a short token, with the cubin
written as that token's module file, loads the same cubin and hashes ~80 bytes a launch: the
same kernel, the same bits.

`source_for(name, cubin)` gives what a launch passes as `compiled_source`: the token once this
process's probe showed that MLX finds such files (`probe()`, run where kernels are built:
the directory and the hash are MLX's and libstdc++'s choices, seen from outside), else the
cubin itself, as before.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import threading
from functools import lru_cache
from pathlib import Path

import mlx.core as mx

from ..mlx_jit_dir import module_dir

log = logging.getLogger(__name__)

TOKEN_PREFIX = b"lockstep-cubin:"
# MLX nests a module name longer than this into directories (get_ptx_path); ours never are
MAX_FILE_NAME = 245
# std::hash<std::string> is std::_Hash_bytes(data, size, this seed) in libstdc++
_STRING_HASH_SEED = 0xC70F6907
PROBE_NAME = "lockstep_module_probe"
PROBE_SOURCE = (f'extern "C" __global__ void {PROBE_NAME}(const float* x, float* out) '
                "{ out[0] = x[0] + 1.0f; }\n")

OFF_ENV = "LOCKSTEP_SHORT_KERNEL_SOURCES"  # 0: every launch passes its cubin's bytes (an A/B)

_lock = threading.Lock()
_verdict: dict[str, object] = {}  # "works": bool, "why": str, once probed


@lru_cache(maxsize=1)
def _hash_bytes():
    """libstdc++'s std::_Hash_bytes, the function behind MLX's std::hash of a source (None
    where this process has no libstdc++: then no token is used)."""
    try:
        fn = ctypes.CDLL("libstdc++.so.6")._ZSt11_Hash_bytesPKvmm
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t]
    return fn


def string_hash(data: bytes) -> int | None:
    """std::hash<std::string> of `data` as MLX (built with libstdc++) computes it."""
    fn = _hash_bytes()
    return None if fn is None else int(fn(data, len(data), _STRING_HASH_SEED))


def module_name(name: str, source: bytes) -> str | None:
    """The name MLX's CustomKernel gives the module of kernel `name` launched from `source`."""
    digest = string_hash(source)
    return None if digest is None else f"{name}_{digest:x}"


def token(cubin: bytes) -> bytes:
    """The short source that stands for `cubin`: it names the content, so one token is one cubin."""
    return TOKEN_PREFIX + hashlib.sha256(cubin).hexdigest().encode()


def _replace(path: Path, data: bytes) -> None:
    partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def write_module(name: str, cubin: bytes, directory: Path | None = None) -> bytes | None:
    """Write `cubin` as the module MLX loads for kernel `name` launched from `token(cubin)`
    (its kernel list first, so a reader never finds the image without it); the token, or None
    where it cannot be written. Checked at every call (a launch shape's plan calls it once, just
    before its first launch): a file removed since, or changed, is written again."""
    short = token(cubin)
    module = module_name(name, short)
    if module is None or len(module) > MAX_FILE_NAME:
        return None
    directory = module_dir() if directory is None else directory
    image, kernels = directory / f"{module}.ptx", directory / f"{module}.txt"
    listing = f"{name}\t{name}\n".encode()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not (kernels.is_file() and kernels.read_bytes() == listing):
            _replace(kernels, listing)
        if not (image.is_file() and image.read_bytes() == cubin):
            _replace(image, cubin)
    except OSError as exc:
        with _lock:
            first, _verdict["unwritable"] = "unwritable" not in _verdict, True
        if first:  # one warning a process: every later kernel would say the same
            log.warning("launching %s (and any other kernel whose module file cannot be written) from its "
                        "cubin's bytes: %s", name, exc)
        return None
    return short


def probe(cubin_of) -> bool:
    """Once a process: whether a launch from a token runs the cubin its module file holds
    (`cubin_of(source) -> bytes` compiles the probe kernel). A failure leaves every launch
    on the cubin's bytes, as before (one warning)."""
    with _lock:
        if "works" in _verdict:
            return _verdict["works"]
    works, why = False, f"{OFF_ENV} is off"
    switched_off = os.environ.get(OFF_ENV, "1").strip().lower() in ("0", "false", "no", "off")
    try:
        short = None if switched_off else write_module(PROBE_NAME, cubin_of(PROBE_SOURCE))
        if short is not None:
            out = mx.fast.precompiled_cuda_kernel(
                name=PROBE_NAME, compiled_source=short, inputs=[mx.array([41.0])], output_shapes=[(1,)],
                output_dtypes=[mx.float32], scalars=[], grid=(1, 1, 1), threadgroup=(1, 1, 1))[0]
            value = out.item()
            works, why = value == 42.0, f"the probe kernel gave {value}, not 42"
        elif not switched_off:
            why = "its module file could not be written"
    except Exception as exc:  # MLX did not find the file: it loaded the token as an image
        why = f"{type(exc).__name__}: {str(exc)[:300]}"
    if works:
        log.info("custom CUDA kernels launch by name (their cubins as MLX's module files in %s)", module_dir())
    elif not switched_off:  # switched off on purpose: nothing to warn of
        log.warning("custom CUDA kernels launch from their cubins' bytes (MLX hashes them at each launch): %s", why)
    with _lock:
        _verdict.setdefault("works", works)
        _verdict.setdefault("why", "" if works else why)
        return _verdict["works"]


def source_for(name: str, cubin: bytes) -> bytes:
    """What a launch of `cubin` as kernel `name` passes MLX: the token where the probe passed
    and the module file is in place, else the cubin."""
    if _verdict.get("works") is not True:
        return cubin
    short = write_module(name, cubin)
    return cubin if short is None else short
