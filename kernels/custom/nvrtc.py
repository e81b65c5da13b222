"""NVRTC through ctypes, and the toolchain a compiled kernel instance depends on.

As MLX compiles its own kernels (mlx/backend/cuda/jit_module.cpp): the NVRTC library libmlx
loaded, `--device-as-default-execution-space`, the device's architecture (`sm_XY`, with `a`
from compute capability 9 on; `compute_XY` and PTX where NVRTC cannot emit its SASS) and MLX's
include paths. kernels/custom/compiled.py keeps what this compiles, once per machine.
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import mlx.core as mx

PROGRAM_NAME = "lockstep_kernel.cu"
SOURCE = Path(__file__).resolve()


@dataclass(frozen=True)
class Toolchain:
    """What a compiled instance depends on besides its source."""

    nvrtc: str  # "13.0"
    mlx: str
    device: str  # the device's name
    capability: tuple[int, int]
    options: tuple[str, ...]  # NVRTC's command line


class CompileError(RuntimeError):
    pass


class Nvrtc:
    """The few NVRTC entry points a compile needs (nvrtc.h), through ctypes. ctypes releases
    the GIL during each call, and NVRTC is thread-safe across programs."""

    def __init__(self, lib: ctypes.CDLL):
        c = ctypes
        self.lib = lib
        for name, args in {
            "nvrtcVersion": [c.POINTER(c.c_int), c.POINTER(c.c_int)],
            "nvrtcCreateProgram": [c.POINTER(c.c_void_p), c.c_char_p, c.c_char_p, c.c_int,
                                   c.POINTER(c.c_char_p), c.POINTER(c.c_char_p)],
            "nvrtcCompileProgram": [c.c_void_p, c.c_int, c.POINTER(c.c_char_p)],
            "nvrtcGetProgramLogSize": [c.c_void_p, c.POINTER(c.c_size_t)],
            "nvrtcGetProgramLog": [c.c_void_p, c.c_char_p],
            "nvrtcGetCUBINSize": [c.c_void_p, c.POINTER(c.c_size_t)],
            "nvrtcGetCUBIN": [c.c_void_p, c.c_char_p],
            "nvrtcGetPTXSize": [c.c_void_p, c.POINTER(c.c_size_t)],
            "nvrtcGetPTX": [c.c_void_p, c.c_char_p],
            "nvrtcDestroyProgram": [c.POINTER(c.c_void_p)],
        }.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, c.c_int
        lib.nvrtcGetErrorString.argtypes, lib.nvrtcGetErrorString.restype = [c.c_int], c.c_char_p

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            raise CompileError(f"{what}: {self.lib.nvrtcGetErrorString(result).decode(errors='replace')}")

    def version(self) -> tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        return major.value, minor.value

    def compile(self, source: str, options: Sequence[str], log: list | None = None) -> bytes:
        """A cubin where the architecture option names `sm_`, else PTX; `log` gets NVRTC's
        program log (ptxas's report with `--ptxas-options=-v`)."""
        c = ctypes
        cubin = any(o.startswith("--gpu-architecture=sm_") for o in options)
        prog = c.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(c.byref(prog), source.encode(), PROGRAM_NAME.encode(),
                                                0, None, None), "nvrtcCreateProgram")
        try:
            argv = (c.c_char_p * len(options))(*(o.encode() for o in options))
            result = self.lib.nvrtcCompileProgram(prog, len(options), argv)
            if result != 0:
                raise CompileError(f"NVRTC: {self._log(prog)[:2000]}")
            if log is not None:
                log.append(self._log(prog))
            get_size, get = ((self.lib.nvrtcGetCUBINSize, self.lib.nvrtcGetCUBIN) if cubin
                             else (self.lib.nvrtcGetPTXSize, self.lib.nvrtcGetPTX))
            size = c.c_size_t()
            self._check(get_size(prog, c.byref(size)), "size of the compiled kernel")
            out = c.create_string_buffer(size.value)
            self._check(get(prog, out), "the compiled kernel")
            return out.raw
        finally:
            self.lib.nvrtcDestroyProgram(c.byref(prog))

    def _log(self, prog) -> str:
        size = ctypes.c_size_t()
        self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        text = ctypes.create_string_buffer(size.value + 1)
        self.lib.nvrtcGetProgramLog(prog, text)
        return text.value.decode(errors="replace")


def _mlx_dir() -> Path:
    return Path(mx.__file__).resolve().parent  # site-packages/mlx (libmlx.so is in lib/)


def load_nvrtc() -> Nvrtc:
    """The NVRTC MLX loaded (libmlx needs libnvrtc.so.13; dlopen by soname finds it), else one
    from the nvidia-* wheels beside MLX or $CUDA_HOME."""
    for name in ("libnvrtc.so.13", "libnvrtc.so.12"):
        try:
            return Nvrtc(ctypes.CDLL(name))
        except OSError:
            pass
    roots = [_mlx_dir().parent / "nvidia" / "*" / "lib"]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            roots.append(Path(os.environ[env]) / "lib64")
    for root in roots:
        for path in sorted(glob.glob(str(root / "libnvrtc.so.1[0-9]*")), reverse=True):
            try:
                return Nvrtc(ctypes.CDLL(path))
            except OSError:
                pass
    raise OSError("no NVRTC library (libnvrtc.so.13 / .12) found")


def device_of_default() -> tuple[str, tuple[int, int]]:
    """The default device's name and compute capability: MLX's device_info, else the driver."""
    try:
        info = mx.device_info()
    except Exception:
        info = {}
    if "compute_capability_major" in info:
        return (str(info.get("device_name", "")),
                (int(info["compute_capability_major"]), int(info["compute_capability_minor"])))
    cuda = ctypes.CDLL("libcuda.so.1")
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    name = ctypes.create_string_buffer(256)
    for result in (cuda.cuInit(0), cuda.cuDeviceGet(ctypes.byref(dev), 0),
                   cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev),  # ..._COMPUTE_CAPABILITY_MAJOR
                   cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev),  # ..._MINOR
                   cuda.cuDeviceGetName(name, 256, dev)):
        if result != 0:
            raise OSError(f"CUDA driver call failed ({result})")
    return name.value.decode(errors="replace"), (major.value, minor.value)


def supports_sass(nvrtc: tuple[int, int], capability: tuple[int, int]) -> bool:
    """Whether this NVRTC emits SASS for the device (MLX's compiler_supports_device_sass)."""
    major, minor = nvrtc
    if major < 9:
        return False
    limit = {9: (7, 2), 10: (7, 5)}.get(major)
    if major == 11 and minor == 0:
        limit = (8, 0)
    elif major == 11 and minor < 8:
        limit = (8, 6)
    return limit is None or capability <= limit


def arch_option(nvrtc: tuple[int, int], capability: tuple[int, int]) -> str:
    """As MLX compiles its own kernels: sm_XY (a cubin) where NVRTC knows the device, else
    compute_XY (PTX); the `a` features from compute capability 9 on."""
    kind = "sm" if supports_sass(nvrtc, capability) else "compute"
    return f"--gpu-architecture={kind}_{capability[0]}{capability[1]}{'a' if capability[0] >= 9 else ''}"


def include_dirs(nvrtc_major: int) -> list[str]:
    """MLX's include paths for NVRTC: its bundled headers and CCCL, then the CUDA headers of
    the nvidia wheel beside it (cu13 / cuda_runtime), else $CUDA_HOME / $CUDA_PATH /
    /usr/local/cuda, else that wheel elsewhere on sys.path. Our sources need only
    <cuda_fp16.h> / <cuda_bf16.h> (PRELUDE stands in for MLX's header)."""
    mlx_include = _mlx_dir() / "include"
    dirs = [str(p) for p in (mlx_include, mlx_include / "cccl") if p.is_dir()]
    wheel = "cu13" if nvrtc_major >= 13 else "cuda_runtime"
    candidates = [_mlx_dir().parent / "nvidia" / wheel / "include"]
    candidates += [Path(os.environ[e]) / "include" for e in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(e)]
    candidates.append(Path("/usr/local/cuda/include"))
    # then any such wheel on the path (MLX installed apart from the nvidia wheels)
    candidates += [Path(entry) / "nvidia" / wheel / "include" for entry in sys.path if entry]
    cuda = next((p for p in candidates if (p / "cuda_fp16.h").is_file()), None)
    if cuda is None:
        raise OSError(f"no CUDA headers (cuda_fp16.h) in {', '.join(map(str, candidates))}")
    return dirs + [str(cuda)]


def detect_toolchain(nvrtc: Nvrtc) -> Toolchain:
    version = nvrtc.version()
    device, capability = device_of_default()
    options = ("--device-as-default-execution-space", arch_option(version, capability),
               *(f"--include-path={d}" for d in include_dirs(version[0])))
    return Toolchain(nvrtc=f"{version[0]}.{version[1]}", mlx=mx.__version__, device=device,
                     capability=capability, options=options)
