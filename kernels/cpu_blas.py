"""Route MLX's CPU float32 matmul from netlib reference BLAS to OpenBLAS.

The `mlx[cpu]` Linux wheel bundles netlib reference BLAS (slow: README, the CPU default) and
imports `cblas_sgemm`/`cblas_dgemm`/`cblas_cgemm` dynamically. A tiny C shim
(`cpu_blas/shim.c`) defines those and forwards to pip's `scipy-openblas32`
(`scipy_cblas_*`). LD_PRELOAD must be set before the process starts, hence
`preload_env` for children and `ensure_preloaded` to re-exec ourselves.

OpenBLAS results depend on the matmul shape (M=1 vs M>1 rows differ bitwise),
so which BLAS is active belongs in any determinism fingerprint: see `active`.
Imports nothing heavy: the server calls this before mlx is loaded.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from lockstep.models import cache_dir

log = logging.getLogger(__name__)

CHOICES = ("openblas", "reference")
SHIM_SOURCE = Path(__file__).with_suffix("") / "shim.c"
# The batch-invariant sgemm the shim runs for M <= L under strategy `cpu_kernel`.
KERNEL_SOURCE = SHIM_SOURCE.with_name("invariant_gemm.c")
# Large calls (prefill chunks) in fixed column blocks on the idle cores.
SPLIT_SOURCE = SHIM_SOURCE.with_name("split_gemm.c")
# Names the built file, so /proc/self/maps can tell the shim is mapped.
_SHIM_STEM = "lockstep-cpu-blas-shim"
# Set on re-exec so a shim that fails to take effect cannot loop us forever.
_REEXEC_MARKER = "LOCKSTEP_CPU_BLAS_REEXEC"
_THREADS_ENV = "OPENBLAS_NUM_THREADS"
# Read by the shim at load: column blocks for calls of >= LARGE_ROWS rows (0 or 1 = off).
_LARGE_THREADS_ENV = "LOCKSTEP_BLAS_LARGE_THREADS"
_LARGE_ROWS_ENV = "LOCKSTEP_BLAS_LARGE_ROWS"


class ShimUnavailable(RuntimeError):
    """The shim cannot be built here; the message says why."""


def openblas_lib() -> Path:
    """libscipy_openblas*.so from the scipy-openblas32 wheel, found without importing it."""
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None or spec.origin is None:
        raise ShimUnavailable("scipy-openblas32 is not installed (pip install scipy-openblas32)")
    libs = sorted((Path(spec.origin).parent / "lib").glob("libscipy_openblas*.so"))
    if not libs:
        raise ShimUnavailable(f"no libscipy_openblas*.so under {Path(spec.origin).parent / 'lib'}")
    return libs[0].resolve()


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise ShimUnavailable("no C compiler found ($CC, cc, gcc)")


def _cache_dir() -> Path:
    return cache_dir.user_root() / "cpu_blas"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _record(so: Path) -> Path:
    """The file beside a built shim holding its size and sha256, written after the shim."""
    return so.with_name(so.name + ".sha256")


def damage(so: Path) -> str | None:
    """Why the cached shim at `so` must not be preloaded (None: it is whole). A truncated .so
    maps past its end and dies of SIGBUS in the loader; a garbled one is skipped by ld.so."""
    try:
        want = _record(so).read_text().split()
        size = so.stat().st_size
        if len(want) != 2 or not want[1].isdigit():
            return f"{_record(so).name} is unreadable"
        if size != int(want[1]):
            return f"it is {size} bytes, {int(want[1])} when built"
        if _digest(so) != want[0]:
            return "its sha256 differs from the one recorded when it was built"
    except FileNotFoundError as exc:
        return f"{Path(exc.filename).name} is missing"
    except (OSError, UnicodeDecodeError) as exc:
        return f"it cannot be read ({cache_dir.reason(exc)})"
    return None


def _compile(out: Path, lib: Path) -> None:
    """Compile the shim into `out` with its record; raise ShimUnavailable (the compiler failed)
    or OSError (the directory cannot be written)."""
    cc = _compiler()
    cache_dir.make_dirs(out.parent)
    # Build beside the target then rename: concurrent builders never see a half-written .so.
    fd, tmp = tempfile.mkstemp(prefix=out.stem, suffix=".tmp.so", dir=out.parent)
    os.close(fd)
    # -ffp-contract=off: the kernel's reduction order is written out (fmaf where meant);
    # a compiler-fused a*b+c elsewhere would make the vector and portable paths differ.
    cmd = [cc, "-O2", "-ffp-contract=off", "-shared", "-fPIC", "-pthread", "-o", tmp,
           str(SHIM_SOURCE), str(KERNEL_SOURCE), str(SPLIT_SOURCE), f"-L{lib.parent}",
           f"-l:{lib.name}", f"-Wl,-rpath,{lib.parent}", "-lm"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            if "No space left on device" in proc.stderr:  # the directory's fault, not the compiler's
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out.parent))
            raise ShimUnavailable(f"compiling the shim failed ({' '.join(cmd)}):\n{proc.stderr.strip()}")
        cache_dir.fsync_path(Path(tmp))
        record = f"{_digest(Path(tmp))} {Path(tmp).stat().st_size}\n".encode()
        os.replace(tmp, out)
        # The record last: a crash between the two leaves a mismatch, so a rebuild.
        cache_dir.write_atomic(_record(out), record)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built CPU BLAS shim %s against %s", out, lib)


def _cached_or_built(out: Path, lib: Path) -> Path:
    if out.exists():
        why = damage(out)
        if why is None:
            return out
        log.warning("rebuilding the cached CPU BLAS shim %s: %s", out, why)
    _compile(out, lib)
    return out


def build_shim() -> Path:
    """Build (once) and return the shim .so; raise ShimUnavailable with the reason.

    A cached shim is checked against the size and sha256 recorded beside it and rebuilt when
    they differ. Where the cache directory cannot be written (not a directory, read-only,
    full) the shim is built under a private temporary directory, said in one line."""
    if not sys.platform.startswith("linux"):
        raise ShimUnavailable(f"LD_PRELOAD shim is Linux-only (platform {sys.platform})")
    lib = openblas_lib()
    source = b"\0".join(p.read_bytes() for p in (SHIM_SOURCE, KERNEL_SOURCE, SPLIT_SOURCE))
    # Keyed by the library path (baked in as rpath) and the source, so a new
    # venv or an edited shim gets its own build and stale ones are never used.
    key = hashlib.sha256(str(lib).encode() + b"\0" + source).hexdigest()[:16]
    name = f"{_SHIM_STEM}-{key}.so"
    try:
        return _cached_or_built(_cache_dir() / name, lib)
    except OSError as exc:
        problem = f"{_cache_dir()}: {cache_dir.reason(exc)}"
    try:
        fallback = cache_dir.fallback_root() / "cpu_blas"
        log.warning("cache directory %s; building the CPU BLAS shim in %s instead", problem, fallback)
        return _cached_or_built(fallback / name, lib)
    except OSError as exc:
        raise ShimUnavailable(f"cannot write the shim to {problem}, nor to the temporary "
                              f"directory: {exc.filename or ''} {cache_dir.reason(exc)}") from exc


def default_threads() -> int:
    """OpenBLAS threads for calls of fewer than `LARGE_ROWS` rows (decode, small passes)."""
    # OpenBLAS workers spin-wait, and MLX's CPU stream plus the server need a
    # core too: on 2 cores, 2 threads ran slower than 1
    # (bench/results/history/2026-11-29-cpu-blas.md).
    # Half the cores, at most 4 (larger untested).
    return max(1, min(4, (os.cpu_count() or 1) // 2))


# Calls of at least this many rows (prefill chunks, passes of several requests) run in
# `large_threads()` fixed column blocks on the cores idle at the time, where they have
# split_gemm.c's MIN_WORK multiply-adds (cpu_blas/split_gemm.c; docs/BENCHMARKS.md, CPU). One
# row (decode: OpenBLAS's sgemv, faster than its sgemm in blocks) stays on `default_threads()`.
LARGE_ROWS = 2


def large_threads() -> int:
    """Column blocks for calls of >= LARGE_ROWS rows; 0 = off. Measured on 2 cores only:
    where OpenBLAS itself runs on more than one thread (4+ cores), it stays off."""
    cores = os.cpu_count() or 1
    return cores if default_threads() == 1 and cores > 1 else 0


def _strip_shim(preload: str) -> list[str]:
    return [p for p in preload.replace(":", " ").split() if _SHIM_STEM not in p]


def preload_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of env (default os.environ) that makes a child process load the shim.

    The OpenBLAS lib dir travels as the shim's rpath, not LD_LIBRARY_PATH, so
    grandchildren's library search is left alone. Raises ShimUnavailable.
    """
    out = dict(os.environ if env is None else env)
    shim = build_shim()
    out["LD_PRELOAD"] = " ".join([str(shim), *_strip_shim(out.get("LD_PRELOAD", ""))])
    out.setdefault(_THREADS_ENV, str(default_threads()))
    out.setdefault(_LARGE_THREADS_ENV, str(large_threads()))
    out.setdefault(_LARGE_ROWS_ENV, str(LARGE_ROWS))
    return out


def reference_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of env with the shim removed from LD_PRELOAD (reference BLAS)."""
    out = dict(os.environ if env is None else env)
    rest = _strip_shim(out.pop("LD_PRELOAD", ""))
    if rest:
        out["LD_PRELOAD"] = " ".join(rest)
    return out


def active() -> str:
    """Which BLAS MLX's CPU matmul uses in this process: openblas | reference | accelerate."""
    from lockstep.models.backend import cpu_blas_in_use

    return cpu_blas_in_use()


def describe() -> str:
    """active() plus the OpenBLAS build, core kernel and threads: for logs and fingerprints."""
    which = active()
    if which != "openblas":
        return which
    lib = ctypes.CDLL(None)
    lib.scipy_openblas_get_config.restype = ctypes.c_char_p
    config = lib.scipy_openblas_get_config().decode()
    # The build's name carries the digest of the shim's C sources, whose kernel makes bits.
    build = next((w for w in Path("/proc/self/maps").read_text().split() if _SHIM_STEM in w), "")
    return (f"openblas ({config}; threads={threads()}; "
            f"shim {Path(build).stem.removeprefix(_SHIM_STEM + '-')}; kernel {kernel_isa()})")


def threads() -> str | None:
    """The shim's thread rule, e.g. "1" or "1, 2 blocks from 64 rows"; None where the shim is
    not active. Blocks are fixed by the call's shape, so its bits are (not by the load)."""
    lib = _shim_symbols()
    if lib is None:
        return None
    small, large, rows = (ctypes.c_int.in_dll(lib, f"lockstep_blas_{name}").value
                          for name in ("small_threads", "large_threads", "large_rows"))
    return str(small) if large <= 1 else f"{small}, {large} blocks from {rows} rows"


def split_counts() -> tuple[int, int] | None:
    """(large calls split into blocks, blocks run by helper threads) so far in this process;
    None where the shim is not active. For tests and benches."""
    lib = _shim_symbols()
    if lib is None:
        return None
    return (ctypes.c_long.in_dll(lib, "lockstep_blas_split_calls").value,
            ctypes.c_long.in_dll(lib, "lockstep_blas_split_helper_pieces").value)


def _shim_symbols():
    """The loaded shim's exports (RTLD_DEFAULT), or None where it is not the active BLAS."""
    return ctypes.CDLL(None) if active() == "openblas" else None


def kernel_isa() -> str | None:
    """Which path the shim's invariant kernel runs here ("avx2+fma" | "portable"), or None
    where the shim is not active."""
    lib = _shim_symbols()
    if lib is None:
        return None
    lib.lockstep_cpu_kernel_isa.restype = ctypes.c_char_p
    return lib.lockstep_cpu_kernel_isa().decode()


def kernel_unavailable_reason() -> str | None:
    """Why strategy `cpu_kernel` cannot run in this process (None: it can)."""
    which = active()
    if which != "openblas":
        return f"the invariant CPU kernel lives in the OpenBLAS shim; MLX's CPU BLAS here is {which}"
    return None


_logged_isa = False
_limit_cell: list = []  # the shim's lockstep_cpu_kernel_limit as a ctypes int (None: no shim), once


def _kernel_limit_cell():
    if not _limit_cell:
        lib = _shim_symbols()
        _limit_cell.append(None if lib is None else ctypes.c_int.in_dll(lib, "lockstep_cpu_kernel_limit"))
    return _limit_cell[0]


def kernel_limit() -> int:
    """The most rows a call may have for the shim's invariant kernel to take it now (0: none,
    or the shim is not active). Read live, cheaply: forms consult it per call."""
    cell = _kernel_limit_cell()
    return 0 if cell is None else cell.value


def set_kernel_limit(call_rows: int) -> None:
    """Route the shim's sgemm calls of M <= call_rows rows (decode's M = 1 included) to its
    invariant kernel; 0 = off. Process-wide; a no-op where the shim is not active."""
    global _logged_isa
    cell = _kernel_limit_cell()
    if cell is None:
        return
    cell.value = max(0, int(call_rows))
    if call_rows > 0 and not _logged_isa:
        _logged_isa = True
        isa = kernel_isa()
        if isa == "portable":
            log.warning("invariant CPU kernel: no AVX2+FMA on this CPU (or forced); running its "
                        "portable path (same reduction order, slower)")
        else:
            log.info("invariant CPU kernel: %s path for sgemm calls of <= %d rows", isa, call_rows)


_reexeced: set[str] = set()  # choices this process was re-executed for


def ensure_preloaded(argv: list[str] | None = None, choice: str = "openblas") -> None:
    """Re-exec this process so MLX uses `choice`; returns only when it already does.

    argv: interpreter arguments to re-run (default sys.orig_argv[1:], which keeps
    `-m module` invocations intact). Call before anything imports mlx.
    """
    if choice not in CHOICES:
        raise ValueError(f"cpu blas must be one of {CHOICES}, got {choice!r}")
    # Popped so our own children may re-exec for a different choice.
    reexeced = os.environ.pop(_REEXEC_MARKER, None)
    if reexeced:
        _reexeced.add(choice)
    if not sys.platform.startswith("linux") or active() == choice:
        return
    if choice in _reexeced:  # this process is the re-exec: a second call must not loop
        if reexeced:
            log.warning("re-exec for cpu blas %r did not take effect; running with %s", choice, active())
        return
    if choice == "openblas":
        try:
            env = preload_env()
        except ShimUnavailable as e:
            log.warning("OpenBLAS shim unavailable, MLX CPU keeps reference BLAS: %s", e)
            return
    else:
        env = reference_env()
    env[_REEXEC_MARKER] = "1"
    args = sys.orig_argv[1:] if argv is None else list(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *args], env)
