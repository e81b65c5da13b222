"""MLX's kernels for the audit's later stages, compiled ahead in child processes.

On CUDA, MLX compiles each tile size of its quantized matmul the first time a call takes it
(NVRTC; about half a minute each on an empty kernel cache), one after another in a process.
`serve` audits the wide and narrow calls after it starts serving (kernels/audit/widths.py),
on its engine thread: a compile there would hold every request for that long. So while the
server starts, child processes run the same probes on random layers of the model's
configurations, a few widths each, in parallel:

    ahead = CompileAhead.start(configs, stages=(WIDE, NARROW))
    ...
    while not ahead.ready(WIDE, timeout=0.05):   # the engine serves between polls
        step_done()
    audit_model(model, stages=(WIDE,), ...)       # loads the compiled kernels from disk

Each child compiles into a directory of its own; once it has exited, its files are moved into
MLX's kernel cache one by one with atomic renames (a module's kernel names before its code), so
no process ever reads a half-written module. The children judge nothing: the audit on the real
layers still decides every verdict, and a child that fails or hangs costs only the time.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

# A child still running after this long is stopped; the audit then compiles what it needs itself.
CHILD_TIMEOUT_S = 600.0
AUDIT_NICENESS = 10  # the deferred stages' children: served after the first answer
REPORT, ERRORS = "report.json", "errors.txt"  # a child's stdout and stderr, in its directory


def pays(backend: str) -> bool:
    """Whether compiling ahead saves time on `backend`: on CUDA (NVRTC, above); Metal's quantized
    kernels come compiled with MLX, and the CPU compiles none."""
    return backend == "cuda"


def kernel_cache_dir() -> Path:
    """Where MLX's CUDA backend reads and writes compiled modules (`MLX_PTX_CACHE_DIR`, else
    its default under the temporary directory): kernels/mlx_jit_dir.py."""
    from ..mlx_jit_dir import module_dir

    return module_dir()


def publish(source: Path, target: Path) -> int:
    """Move the modules a child compiled into `source` to `target`, where another process may be
    reading: each file is copied beside its place and renamed into it (atomic), a module's code
    (`.ptx`, which MLX looks for first) last, and a module already there is left alone. Returns
    the number of modules moved."""
    moved = 0
    for code in sorted(source.rglob("*.ptx")):
        relative = code.relative_to(source)
        if (target / relative).exists():
            continue
        for part in sorted(code.parent.glob(code.stem + ".*"), key=lambda p: p.suffix == ".ptx"):
            destination = target / relative.parent / part.name
            destination.parent.mkdir(parents=True, exist_ok=True)
            staging = destination.with_name(f".{part.name}.{os.getpid()}.part")
            shutil.copyfile(part, staging)
            os.replace(staging, destination)
        moved += 1
    return moved


def child_widths(stages, rows_of) -> list[tuple[str, tuple[int, ...]]]:
    """(stage, widths) of each child: a stage's wide calls together (on CUDA one tile size takes
    every call of 33 rows and more), each narrow width alone (8 and 24 rows take tiles of their
    own; the others compile nothing and cost a child little)."""
    from .widths import WIDE

    children = []
    for stage in stages:
        widths = sorted(rows_of(stage))
        if not widths:
            continue
        if stage == WIDE:
            children.append((stage, tuple(widths)))
        else:
            children += [(stage, (w,)) for w in widths]
    return children


@dataclasses.dataclass
class _Child:
    stage: str
    widths: tuple[int, ...]
    process: subprocess.Popen
    directory: Path
    started: float
    report: list | None = None
    published: bool = False
    what: str = ""  # what it compiles, for the log (default: its widths)

    def describe(self) -> str:
        return self.what or f"widths {list(self.widths)}"


def spawn_child(stage: str, module: str, spec: dict, *, widths: tuple[int, ...] = (), what: str = "",
                niceness: int = 0, python: str = sys.executable) -> _Child:
    """A child process running `python -m module` with `spec` (JSON) on its stdin, compiling into
    a directory of its own (published into MLX's cache by `CompileAhead` once it has exited);
    `niceness` lowers its CPU priority (work that can wait for another's)."""
    directory = Path(tempfile.mkdtemp(prefix="lockstep-compile-ahead-"))
    env = {**os.environ, "MLX_PTX_CACHE_DIR": str(directory)}
    # its report and errors go to files (a pipe nobody reads while it runs could fill)
    with open(directory / REPORT, "w") as out, open(directory / ERRORS, "w") as errors:
        process = subprocess.Popen([python, "-m", module], stdin=subprocess.PIPE, stdout=out, stderr=errors,
                                   env=env, text=True, preexec_fn=(lambda: os.nice(niceness)) if niceness else None)
    process.stdin.write(json.dumps(spec))
    process.stdin.close()
    return _Child(stage, widths, process, directory, time.perf_counter(), what=what)


class CompileAhead:
    """The children compiling the kernels of some audit stages; `ready(stage)` once every child
    of that stage has exited and its kernels are in MLX's cache."""

    def __init__(self, children: list[_Child], cache: Path):
        self.children, self.cache = children, cache
        self._lock = threading.Lock()
        atexit.register(self.close)

    @classmethod
    def start(cls, configs, stages, *, untaken=None, prompt_rows: int = 96, seed: int = 0,
              python: str = sys.executable) -> CompileAhead:
        """Children for `stages` over `configs` (LayerConfigs; `untaken`: each one's untaken path
        prefixes, kernels/audit/patch.py)."""
        from .probes import probe_paths
        from .widths import stage_of

        untaken = untaken or {}
        cache = kernel_cache_dir()
        rows_of = lambda stage: {r for cfg in configs for p, r in probe_paths(cfg.kind, prompt_rows)
                                 if stage_of(p, r) == stage and not p.startswith(untaken.get(cfg, ()))}
        spec = {"configs": [{**dataclasses.asdict(cfg), "untaken": list(untaken.get(cfg, ()))} for cfg in configs],
                "prompt_rows": prompt_rows, "seed": seed}
        # niced: a first answer's own children (server/warm_ahead.py) and the server come first
        children = [spawn_child(stage, __name__, {**spec, "stage": stage, "widths": list(widths)},
                                widths=widths, niceness=AUDIT_NICENESS, python=python)
                    for stage, widths in child_widths(stages, rows_of)]
        log.info("compiling ahead the kernels of the %s audit in %d child processes (widths %s)",
                 " and ".join(stages), len(children), ", ".join(str(list(c.widths)) for c in children))
        return cls(children, cache)

    @classmethod
    def for_report(cls, model, report) -> CompileAhead | None:
        """Children for the stages `report` deferred, over `model`'s configurations still on
        their own kernels (one given a stand-in was probed on every path); None if none is."""
        from .patch import quantized_layers, untaken_paths
        from .report import OK

        verdicts = {c.config: c.verdict for c in report.configs}
        configs = [cfg for cfg in quantized_layers(model) if verdicts.get(cfg, OK) == OK]
        if not configs or not report.deferred:
            return None
        return cls.start(configs, report.deferred, untaken={cfg: untaken_paths(model, cfg) for cfg in configs})

    def ready(self, stage: str, timeout: float = 0.0) -> bool:
        """Whether every child of `stage` is done and its kernels published; waits up to `timeout`."""
        deadline = time.perf_counter() + timeout
        while True:
            with self._lock:
                pending = [c for c in self.children if c.stage == stage and not self._finish(c)]
            if not pending or time.perf_counter() >= deadline:
                return not pending
            time.sleep(min(0.01, max(0.0, deadline - time.perf_counter())))

    def _finish(self, child: _Child) -> bool:
        if child.published:
            return True
        if child.process.poll() is None:
            if time.perf_counter() - child.started < CHILD_TIMEOUT_S:
                return False
            child.process.kill()
            child.process.wait()
            log.warning("compiling ahead (%s): stopped after %.0f s", child.describe(), CHILD_TIMEOUT_S)
        try:
            child.report = json.loads((child.directory / REPORT).read_text())
        except (OSError, ValueError):
            child.report = None
        if child.process.returncode != 0:
            errors = (child.directory / ERRORS).read_text(errors="replace").strip().splitlines()
            log.warning("compiling ahead (%s): the child exited with %d%s", child.describe(),
                        child.process.returncode, f": {errors[-1]}" if errors else "")
        moved = publish(child.directory, self.cache)
        shutil.rmtree(child.directory, ignore_errors=True)
        child.published = True
        log.info("compiled ahead (%s, %s) in %.1f s: %d kernel modules", child.stage,
                 child.describe(), time.perf_counter() - child.started, moved)
        return True

    def close(self) -> None:
        """Stop the children still running (the server is stopping)."""
        for child in self.children:
            if child.process.poll() is None:
                child.process.kill()
                child.process.wait()
            shutil.rmtree(child.directory, ignore_errors=True)


def random_layer(cfg, rows: int):
    """A quantized layer of `cfg` (a LayerConfig) with `rows` output rows, random weights."""
    import mlx.core as mx
    import mlx.nn as nn

    dtype = getattr(mx, cfg.dtype)
    quant = dict(group_size=cfg.group_size, bits=cfg.bits, mode=cfg.mode)
    k = cfg.shape[-1]
    if cfg.kind == "linear":
        layer = nn.QuantizedLinear(k, rows, bias=cfg.has_bias, **quant)
    elif cfg.kind == "embedding":
        layer = nn.QuantizedEmbedding(rows, k, **quant)
    else:
        from mlx_lm.models.switch_layers import QuantizedSwitchLinear

        layer = QuantizedSwitchLinear(k, rows, cfg.shape[0], bias=cfg.has_bias, **quant)
    # affine scales and biases are in the activation dtype; fp modes' scales stay uint8
    layer.update({name: layer[name].astype(dtype) for name in ("scales", "biases", "bias")
                  if name in layer and mx.issubdtype(layer[name].dtype, mx.floating)})
    return layer


def compile_widths(spec: dict) -> list:
    """The child's work: every probe of `spec["stage"]` at `spec["widths"]` on a random layer of
    each configuration. Returns, per configuration, its label, the paths run and their seconds
    (or the error)."""
    from .patch import _probe_every_path
    from .probes import probe_paths
    from .report import LayerConfig
    from .slicing import backend_kind, full_size, sliced_rows
    from .widths import stage_of

    backend, widths, stage = backend_kind(), set(spec["widths"]), spec["stage"]
    report = []
    for fields in spec["configs"]:
        untaken = tuple(fields.pop("untaken"))
        cfg = LayerConfig(**{**fields, "shape": tuple(fields["shape"])})
        n = cfg.shape[-2]
        paths = [(p, r) for p, r in probe_paths(cfg.kind, spec["prompt_rows"])
                 if r in widths and stage_of(p, r) == stage and not p.startswith(untaken)]
        whole = any(full_size(p, r, n, backend) for p, r in paths)
        started = time.perf_counter()
        try:
            layer = random_layer(cfg, n if whole else sliced_rows(n, backend))
            # the probes slice a layer of n rows; one already of the slice's size stays whole
            results = _probe_every_path(layer, cfg, spec["seed"], spec["prompt_rows"], backend,
                                        stages=(stage,), untaken=untaken, widths=widths) or []
            report.append({"config": cfg.label(), "seconds": time.perf_counter() - started,
                           "paths": [[p.path, p.rows] for p in results]})
        except Exception as exc:  # the audit of the real layer will see it, and judge it
            report.append({"config": cfg.label(), "error": f"{type(exc).__name__}: {exc}"})
    return report


if __name__ == "__main__":
    json.dump(compile_widths(json.loads(sys.stdin.read())), sys.stdout)
