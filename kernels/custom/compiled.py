"""CUDA kernel instances compiled once per machine and launched from their cubins.

`mx.fast.cuda_kernel` compiles each template instance with NVRTC in every process (MLX keeps
no disk cache for custom kernels), so every start paid for all of ours again. Here each
instance is a small translation unit of its own (the kernel's source, then a generated
`extern "C" __global__` wrapper whose template values are constants and whose array sizes
are int arguments), compiled by NVRTC through ctypes into a cubin kept under the verdict
cache root (`<root>/cubin/<sha256>.cubin`, keyed by the whole source, the NVRTC options,
NVRTC's and MLX's versions and the device) and launched with
`mx.fast.precompiled_cuda_kernel`, by a short token for its cubin where this process's probe
showed that works (module_files.py: MLX would hash the whole cubin at every launch). A restart reads the files and compiles nothing; a fresh
start compiles the instances it is told about at once (`precompile`; one thread by default:
NVRTC compiles in one process do not overlap:
bench/results/history/2026-12-01-startup-serve-before-proofs-issue29.md).

Where this cannot run (no NVRTC library, no CUDA headers, a compile that fails, a kernel
that fails its smoke test on this path) one warning says why and the loaders keep today's
`mx.fast.cuda_kernel` launch: `launcher(...)` returns their fallback, per loader (`group`).
`LOCKSTEP_PRECOMPILED_KERNELS=0` keeps every loader on `mx.fast.cuda_kernel`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable, Sequence

import mlx.core as mx

from ..verdict_cache import default_root, read_file, write_file
from . import module_files
from .nvrtc import SOURCE as NVRTC_SOURCE
from .nvrtc import Toolchain, detect_toolchain, load_nvrtc
from .smoke_cache import smoke_verdict

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the wrapper or the file layout changes
NAMESPACE = "cubin"
OFF_ENV = "LOCKSTEP_PRECOMPILED_KERNELS"
# What MLX's own header (mlx/backend/cuda/device/utils.cuh, included by every cuda_kernel
# source) gave our files beyond <cuda_fp16.h> / <cuda_bf16.h>: the fixed-width integer
# types and INFINITY (+inf, as libcu++'s numeric_limits<float>::infinity()). Not through
# CCCL's headers: <cuda/std/limits> or <cmath> put ~60 KB of static members into every cubin
# (MLX hashes the cubin at each launch) and made compiles up to 8x slower.
PRELUDE = ("typedef signed char int8_t;\ntypedef short int16_t;\ntypedef int int32_t;\n"
           "typedef long int64_t;\ntypedef unsigned char uint8_t;\ntypedef unsigned short uint16_t;\n"
           "typedef unsigned int uint32_t;\ntypedef unsigned long uint64_t;\n"
           "#ifndef INFINITY\n#define INFINITY __int_as_float(0x7f800000)\n#endif\n")
_MAGIC = b"LSCUBIN\x01"


# -- kernel families: a source and the wrapper of one instance ------------------------------

def _c_types() -> dict:
    # as MLX's dtype_to_cuda_type names them
    return {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16",
            mx.uint32: "uint32_t", mx.uint8: "uint8_t", mx.int32: "int32_t"}


_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "uint32": "u32", "uint8": "u8",
          "int32": "i32"}


def _dtype_name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


class Family:
    """One kernel of a source file: the `mx.fast.cuda_kernel` body it runs, and how that body
    becomes an `extern "C" __global__` function of fixed template values.

    inputs / outputs: (name, type) in launch order, type a C type or the name of a dtype
    template value ("T"); scalars: (name, the `<input>_shape[i]` expression of the body it
    replaces) in the order they follow the outputs. `threads`: the block size every launch
    uses, given where it is above 256 (a function of the template where it varies): the wrapper
    then says it (`__launch_bounds__`), so the compiler keeps each instance within the registers
    such a block may hold (65,536: 128 a thread at 512), which it does not assume otherwise.
    Identity-hashed (one per kernel)."""

    def __init__(self, name: str, group: str, header: str, body: str, inputs, outputs, scalars,
                 threads: int | None = None):
        self.name, self.group, self.header, self.body = name, group, header, body
        self.threads = threads
        self.inputs, self.outputs = tuple(inputs), tuple(outputs)
        self.scalars = tuple(scalars)
        call = body
        for scalar, expression in self.scalars:
            call = call.replace(expression, scalar)
        if any(f"{n}_{what}" in call for n, _ in self.inputs for what in ("shape", "strides", "ndim")):
            raise ValueError(f"{name}: the body reads array metadata no scalar replaces: {call}")
        self.call = call  # the body with the shapes replaced by the scalar parameters

    @property
    def scalar_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.scalars)

    def symbol(self, template) -> str:
        parts = [self.name]
        for _, value in template:
            if isinstance(value, bool):
                parts.append("t" if value else "f")
            elif isinstance(value, int):
                parts.append(str(value) if value >= 0 else f"m{-value}")
            else:
                parts.append(_SHORT[_dtype_name(value)])
        return "_".join(parts)

    def parameters(self, template) -> list[tuple[str, str]]:
        """(C type, name) of the wrapper's parameters: inputs, outputs, scalars."""
        types = _c_types()
        dtypes = {name: value for name, value in template
                  if not isinstance(value, (bool, int))}

        def c_type(t):
            return types[dtypes[t]] if t in dtypes else t

        return ([(f"const {c_type(t)}*", n) for n, t in self.inputs]
                + [(f"{c_type(t)}*", n) for n, t in self.outputs]
                + [("int", n) for n in self.scalar_names])

    def block_threads(self, template) -> int | None:
        """The block size this instance's launches use, where the family says it (`threads`:
        a number, or a function of the template for families whose block size varies)."""
        return self.threads(tuple(template)) if callable(self.threads) else self.threads

    def wrapper(self, template) -> str:
        types = _c_types()
        params = ", ".join(f"{t} {n}" for t, n in self.parameters(template))
        threads = self.block_threads(template)
        bounds = f"__launch_bounds__({threads}) " if threads else ""
        lines = [f'extern "C" __global__ void {bounds}{self.symbol(template)}({params}) {{']
        for name, value in template:
            if isinstance(value, bool):
                lines.append(f"  constexpr bool {name} = {'true' if value else 'false'};")
            elif isinstance(value, int):
                lines.append(f"  constexpr int {name} = {value};")
            else:
                lines.append(f"  using {name} = {types[value]};")
        lines += [f"  {self.call}", "}"]
        return "\n".join(lines) + "\n"

    def source(self, template) -> str:
        """The whole translation unit of one instance."""
        return PRELUDE + self.header + self.wrapper(template)

    def scalar_values(self, scalars: dict) -> list[int]:
        """The launch's scalars in the wrapper's order; the names must be exactly the family's."""
        if set(scalars) != set(self.scalar_names):
            raise ValueError(f"{self.name} takes scalars {self.scalar_names}, got {sorted(scalars)}")
        return [int(scalars[name]) for name in self.scalar_names]


# -- the cache: sources -> cubins, once per machine ----------------------------------------

def cache_key(source: str, toolchain: Toolchain) -> str:
    blob = json.dumps({"format": FORMAT, "source": source, "options": list(toolchain.options),
                       "nvrtc": toolchain.nvrtc, "mlx": toolchain.mlx, "device": toolchain.device,
                       "capability": list(toolchain.capability)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _pack(blob: bytes) -> bytes:
    return _MAGIC + hashlib.sha256(blob).digest() + blob


def _unpack(data: bytes) -> bytes | None:
    """The stored cubin, or None when the file is not one of ours or does not check out."""
    head = len(_MAGIC) + 32
    if len(data) <= head or not data.startswith(_MAGIC):
        return None
    blob = data[head:]
    return blob if hashlib.sha256(blob).digest() == data[len(_MAGIC):head] else None


def default_workers() -> int:
    """One: NVRTC compiles in one process do not overlap, so more threads only add
    contention (measured:
    bench/results/history/2026-12-01-startup-serve-before-proofs-issue29.md)."""
    return 1


class CubinCache:
    """Cubins by source: in memory for this process, on disk for the machine.

    compile_fn(source, options) -> bytes runs NVRTC (a stand-in in tests); `compiled` counts
    its calls, `compile_seconds` adds up their time (over every thread)."""

    def __init__(self, directory, toolchain: Toolchain, compile_fn: Callable[[str, Sequence[str]], bytes]):
        self.dir = Path(directory)
        self.toolchain = toolchain
        self.compile_fn = compile_fn
        self.compiled = 0
        self.compile_seconds = 0.0
        self._memory: dict[str, bytes] = {}
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()

    def key(self, source: str) -> str:
        return cache_key(source, self.toolchain)

    def get(self, source: str) -> bytes:
        return self.get_many([source])[0]

    def get_many(self, sources: Sequence[str], workers: int | None = None,
                 return_exceptions: bool = False) -> list:
        """The cubin of each source, in order: from memory, else the disk, else compiled,
        each distinct source once, up to `workers` at a time. A failed compile raises (or,
        with return_exceptions, stands in the list as its exception) and is not kept."""
        keys = [self.key(s) for s in sources]
        mine: dict[str, tuple[str, Future]] = {}
        theirs: dict[str, Future] = {}
        with self._lock:
            for key, source in zip(keys, sources):
                if key in self._memory or key in mine or key in theirs:
                    continue
                if key in self._pending:  # another thread is on it: wait for that one
                    theirs[key] = self._pending[key]
                else:
                    future = Future()
                    self._pending[key] = future
                    mine[key] = (source, future)
        if mine:
            work = list(mine.items())
            count = min(len(work), workers or default_workers())
            if count <= 1:
                for item in work:
                    self._build(item)
            else:
                with ThreadPoolExecutor(count, thread_name_prefix="lockstep-nvrtc") as pool:
                    list(pool.map(self._build, work))
        out = []
        for key in keys:
            blob = self._memory.get(key)
            if blob is None:
                future = mine[key][1] if key in mine else theirs[key]
                try:
                    blob = future.result()
                except Exception as exc:
                    if not return_exceptions:
                        raise
                    blob = exc
            out.append(blob)
        return out

    def _build(self, item) -> None:
        key, (source, future) = item
        try:
            blob = self._load(key)
            if blob is None:
                started = time.perf_counter()
                blob = bytes(self.compile_fn(source, self.toolchain.options))
                with self._lock:
                    self.compiled += 1
                    self.compile_seconds += time.perf_counter() - started
                self._store(key, blob)
        except BaseException as exc:
            with self._lock:
                del self._pending[key]
            future.set_exception(exc)
            return
        with self._lock:
            self._memory[key] = blob
            del self._pending[key]
        future.set_result(blob)

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.cubin"

    def _load(self, key: str) -> bytes | None:
        path = self.path(key)
        data = read_file(path, "cached kernel (compiling again)")
        blob = None if data is None else _unpack(data)
        if data is not None and blob is None:
            log.warning("compiling again: corrupt cached kernel %s", path)
        return blob

    def _store(self, key: str, blob: bytes) -> None:
        write_file(self.path(key), _pack(blob), "compiled kernel")


@lru_cache(maxsize=None)
def default_cache() -> CubinCache | None:
    """This machine's cache, or None where the precompiled path cannot run (one warning)."""
    if os.environ.get(OFF_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        log.info("%s is off: custom CUDA kernels compile through mx.fast.cuda_kernel", OFF_ENV)
        return None
    if not mx.cuda.is_available():
        return None
    try:
        nvrtc = load_nvrtc()
        toolchain = detect_toolchain(nvrtc)
    except Exception as exc:  # no NVRTC, device or headers: today's path
        log.warning("custom CUDA kernels compile through mx.fast.cuda_kernel in every process: %s", exc)
        return None
    return CubinCache(default_root() / NAMESPACE, toolchain, nvrtc.compile)


def compile_seconds() -> float:
    """NVRTC time so far in this process, added up over threads (0 where the path is off)."""
    cache = default_cache() if mx.cuda.is_available() else None
    return cache.compile_seconds if cache is not None else 0.0


# -- the loaders' side: instances, launches, fallback --------------------------------------

_disabled: dict[str, str] = {}
_resets: dict[str, list[Callable[[], None]]] = {}
_state_lock = threading.Lock()


def on_disable(group: str, reset: Callable[[], None]) -> None:
    """Call `reset` (a loader's plan-cache clear) when `group` leaves the precompiled path."""
    _resets.setdefault(group, []).append(reset)


def enabled(group: str) -> bool:
    return group not in _disabled and default_cache() is not None


def mode(group: str) -> str:
    return "precompiled" if enabled(group) else "cuda_kernel"


def disable(group: str, why: str) -> None:
    """`group`'s launches go back to mx.fast.cuda_kernel for the rest of the process."""
    with _state_lock:
        if group in _disabled:
            return
        _disabled[group] = why
    log.warning("precompiled %s kernels switched off, using mx.fast.cuda_kernel: %s", group, why[:2000])
    for reset in _resets.get(group, ()):
        reset()


def cubin(family: Family, template) -> bytes | None:
    """The instance's cubin, or None where its group is not on the precompiled path (then
    the caller launches through mx.fast.cuda_kernel)."""
    if not enabled(family.group):
        return None
    try:
        return default_cache().get(family.source(template))
    except Exception as exc:
        disable(family.group, f"{family.symbol(template)}: {type(exc).__name__}: {exc}")
        return None


def launcher(family: Family, launch: dict, scalars: dict, fallback: Callable[[], tuple]) -> tuple:
    """(call, keyword arguments but inputs) of one launch shape: mx.fast.precompiled_cuda_kernel
    with the instance's cubin, or fallback() (today's cuda_kernel and its arguments).
    `launch` holds template, grid, threadgroup, output_shapes and output_dtypes, and
    shared_memory where the kernel takes dynamic shared memory (the fallback's kernel was made
    with it: cuda_kernel takes it when made, not per call)."""
    template = tuple(launch["template"])
    values = family.scalar_values(scalars)
    blob = cubin(family, template)
    if blob is None:
        return fallback()
    name = family.symbol(template)
    return mx.fast.precompiled_cuda_kernel, dict(
        name=name, compiled_source=module_files.source_for(name, blob), scalars=values,
        grid=launch["grid"], threadgroup=launch["threadgroup"],
        output_shapes=launch["output_shapes"], output_dtypes=launch["output_dtypes"],
        shared_memory=launch.get("shared_memory", 0),
        ensure_row_contiguous=True,  # as cuda_kernel's default
    )


def sizes_are_scalars(call) -> bool:
    """Whether `call` (from `launcher`) is the precompiled launch, whose array sizes are its
    scalar arguments: it takes x of any shape of the planned size (its rows made contiguous)
    and gives outputs of whatever shapes the launch names, so a layer's call needs no reshape
    nodes around it. cuda_kernel's bodies read the inputs' shapes instead."""
    return call is mx.fast.precompiled_cuda_kernel


def shaped_launch(call, plan: dict, x_shape: tuple, shapes: list) -> Callable[..., list]:
    """A compiled launch of x and further inputs giving outputs of `shapes` (each the size of
    the plan's output): the precompiled launch takes x as it is and writes those shapes itself;
    cuda_kernel's gets x as the plan's `x_shape` and its outputs reshaped. Either way the same
    kernel, the same bits."""
    shapes = [tuple(shape) for shape in shapes]
    if sizes_are_scalars(call):
        direct = dict(plan, output_shapes=shapes)
        return mx.compile(lambda x, *rest: call(inputs=[x, *rest], **direct))
    return mx.compile(lambda x, *rest: [y.reshape(shape) for y, shape in zip(
        call(inputs=[x.reshape(x_shape), *rest], **plan), shapes)])


def traced(call, launch: dict) -> Callable[..., list]:
    """One launch shape's `call(inputs=[...], **launch)` as an mx.compile'd function of its
    inputs: MLX makes each later node from the traced primitive instead of converting every
    argument again, the cubin's bytes among them
    (bench/results/history/2026-12-02-h200-launch-cost-cuda-graphs-issues27-28.md). The same
    kernel with the same arguments: the same bits."""
    return mx.compile(lambda *inputs: call(inputs=list(inputs), **launch))


def traced_on(which: str, call, launch: dict) -> Callable[..., list]:
    """`traced` for a CUDA launch; elsewhere (Metal's metal_kernel, never run here) the direct
    call as a function of the inputs."""
    if which == "cuda":
        return traced(call, launch)
    return lambda *inputs: call(inputs=list(inputs), **launch)


def probe_module_files() -> bool:
    """Whether launches pass a short token for their cubin (module_files.py), probed once a
    process before the first kernels are built, outside any traced function."""
    cache = default_cache()
    return cache is not None and mx.cuda.is_available() and module_files.probe(cache.get)


def precompile(instances: Iterable[tuple[Family, tuple]], workers: int | None = None) -> int:
    """Compile (or read) every (family, template) instance at once, `workers` at a time
    (default_workers()). Returns how many are ready; 0 where the path is off. A failed
    compile switches its group back to mx.fast.cuda_kernel."""
    cache = default_cache()
    if cache is None:
        return 0
    probe_module_files()
    todo = {}
    for family, template in instances:
        if family.group not in _disabled:
            todo.setdefault((family, tuple(template)), None)
    if not todo:
        return 0
    pairs = list(todo)
    start, compiled_before = time.perf_counter(), cache.compiled
    results = cache.get_many([f.source(t) for f, t in pairs], workers, return_exceptions=True)
    ready = 0
    for (family, template), result in zip(pairs, results):
        if isinstance(result, Exception):
            disable(family.group, f"{family.symbol(template)}: {type(result).__name__}: {result}")
        else:
            ready += 1
    log.info("custom CUDA kernels: %d instances ready (%d compiled) in %.2f s", ready,
             cache.compiled - compiled_before, time.perf_counter() - start)
    return ready


def smoke(name: str, group: str, run, *sources) -> str | None:
    """A loader's smoke verdict (smoke_cache.smoke_verdict) for the path its launches take:
    on the precompiled path a failure or crash switches `group` back to mx.fast.cuda_kernel
    (one warning) and the test runs again there; a pass is kept per path."""
    if mode(group) == "precompiled":
        probe_module_files()
        try:
            problem = smoke_verdict(f"{name} precompiled", run, *sources)
        except Exception as exc:
            problem = f"{type(exc).__name__}: {str(exc)[:300]}"
        if problem is None:
            return None
        disable(group, f"{name} failed its smoke test: {problem}")
    return smoke_verdict(name, run, *sources)


SOURCE = Path(__file__).resolve()
SOURCES = (SOURCE, NVRTC_SOURCE)  # the loaders name these among their smoke-test sources
