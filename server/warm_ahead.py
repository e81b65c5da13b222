"""The kernels a first answer takes, compiled ahead in small child processes while the server starts.

On CUDA, MLX compiles a kernel module the first time a call takes it (NVRTC; 3.5-6 s each on an
empty kernel cache), one after another in a process. A fresh start's first answer takes a
handful in turn: the embedding's lookups (the audit, then the warm-up), the MLP's fused
activation (the warm-up's forward, and again traced into the compiled decode pass of the first
request) and the KV pool's row writes (the engine). Each is a recipe of a few MLX calls on
small arrays of the model's dtypes, run by a child of its own, all at once, from the moment the
model is loaded:

    jobs = recipes(model)                   # after the load (and any quantization)
    ahead = WarmAhead.start(jobs)           # unless WarmAhead.needed(jobs) is False: a restart
    ahead.wait(LOOKUPS)                     # before the audit's lookups
    ahead.wait(ACTIVATION)                  # before the warm-up's forward
    ahead.wait_all()                        # before the engine: the rest
    ahead.close()                           # a child later than that: stopped (never published)

A child imports MLX and nothing else (no model, no tokenizer, no mlx-lm package), so it takes
seconds, not the server's import. MLX names a module by its operation and dtypes (a fused
kernel by its graph), so a recipe compiles the module the server's call will look for; the
kernels reach MLX's cache as the audit's compile-ahead children's do
(kernels/audit/compile_ahead.py). The children judge nothing, and a child that fails or is late
costs only the time: the server compiles what it still lacks itself.
"""
from __future__ import annotations

import json
import logging
import sys
import time

import mlx.core as mx

log = logging.getLogger(__name__)

LOOKUPS, ROW_WRITES = "lookups", "row writes"
ACTIVATION, TRACED_ACTIVATION = "activation", "traced activation"  # called alone; inside a compiled call
# How long the server waits for a recipe's children before compiling what it lacks itself.
WAIT_S = 30.0


# ------------------------------------------------------------------ the server's side


def lookup_dtypes(model) -> list[str]:
    """The dtypes the model's embedding lookups gather (a quantized embedding's packed weights,
    scales and biases; a plain one's weight), by name."""
    import mlx.nn as nn

    found = set()
    for _, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.QuantizedEmbedding)):
            for name in ("weight", "scales", "biases"):
                if name in module:
                    found.add(_name(module[name].dtype))
    return sorted(found)


def forward_facts(model) -> tuple[list[dict], list[str]]:
    """What one token's forward takes, found by building it lazily (nothing runs) with the
    compiled activations of `mlx_lm.models.activations` the model's module calls replaced by
    recorders: those calls, by function and argument dtypes, and the dtypes of the KV its caches
    keep (none for a cache without keys, a recurrent layer's). Nothing where the forward cannot
    be built so: the server then compiles those kernels itself."""
    from mlx_lm.models import activations
    from mlx_lm.models.cache import make_prompt_cache

    module = sys.modules[type(model).__module__]
    names = [n for n, f in vars(activations).items() if callable(f) and getattr(module, n, None) is f]
    calls, kv = [], set()

    def recorder(name, function):
        def record(*args):
            if all(isinstance(a, mx.array) for a in args):
                call = {"function": name, "args": [[_name(a.dtype), a.ndim == 0] for a in args]}
                if call not in calls:
                    calls.append(call)
            return function(*args)
        return record

    try:
        for name in names:
            setattr(module, name, recorder(name, getattr(activations, name)))
        cache = make_prompt_cache(model)
        model(mx.array([[1]], mx.int32), cache=cache)  # a graph, never evaluated
        kv = {_name(c.keys.dtype) for c in cache if getattr(c, "keys", None) is not None}
    except Exception as exc:
        log.info("a lazy forward of the model failed (%s: %s): its kernels are compiled as it runs",
                 type(exc).__name__, exc)
        calls, kv = [], set()
    finally:
        for name in names:
            setattr(module, name, getattr(activations, name))
    return calls, sorted(kv)


def recipes(model) -> list[tuple[str, dict]]:
    """(stage, spec) of each child for `model` as loaded."""
    calls, kv = forward_facts(model)
    return ([(LOOKUPS, {"recipe": LOOKUPS, "dtype": d}) for d in lookup_dtypes(model)]
            + [(ROW_WRITES, {"recipe": ROW_WRITES, "dtype": d}) for d in kv]
            + [(stage, {"recipe": stage, **call}) for call in calls for stage in (ACTIVATION, TRACED_ACTIVATION)])


def stamp(jobs: list[tuple[str, dict]]):
    """The file in MLX's kernel cache that says these recipes' kernels were compiled into it (it
    goes with the cache when the cache is cleared: a reboot's temporary directory)."""
    import hashlib

    from lockstep.kernels.audit.compile_ahead import kernel_cache_dir

    key = hashlib.sha256(json.dumps(jobs, sort_keys=True).encode()).hexdigest()[:16]
    return kernel_cache_dir() / f"lockstep-first-answer-{key}.done"


class WarmAhead:
    """The children compiling a first answer's kernels; `wait(stage)` publishes them."""

    def __init__(self, ahead, done):
        self.ahead = ahead  # a kernels.audit.compile_ahead.CompileAhead over the children
        self.done = done  # stamped once every child has compiled its recipe

    @staticmethod
    def needed(jobs) -> bool:
        """Whether this kernel cache lacks the kernels of `jobs` (`recipes(model)`)."""
        return bool(jobs) and not stamp(jobs).exists()

    @classmethod
    def start(cls, jobs, *, python: str = sys.executable) -> WarmAhead:
        from lockstep.kernels.audit.compile_ahead import CompileAhead, kernel_cache_dir, spawn_child

        children = [spawn_child(stage, __name__, spec, what=describe(spec), python=python) for stage, spec in jobs]
        log.info("compiling ahead the first answer's kernels in %d child processes (%s)",
                 len(children), ", ".join(f"{c.stage} {c.what}" for c in children))
        return cls(CompileAhead(children, kernel_cache_dir()), stamp(jobs))

    def wait(self, stage: str, timeout: float = WAIT_S) -> bool:
        """Wait up to `timeout` for `stage`'s children; whether their kernels are in MLX's cache."""
        started = time.perf_counter()
        done = self.ahead.ready(stage, timeout=timeout)
        if not done:
            log.warning("compiling ahead (%s): not done after %.0f s; compiling here", stage, timeout)
        elif time.perf_counter() - started > 0.5:
            log.info("waited %.1f s for the %s kernels compiled ahead", time.perf_counter() - started, stage)
        return done

    def wait_all(self, timeout: float = WAIT_S) -> bool:
        """Wait for every child (up to `timeout` in all); once each has compiled its recipe, the
        cache is stamped and later starts spawn none."""
        deadline = time.perf_counter() + timeout
        stages = dict.fromkeys(child.stage for child in self.ahead.children)  # in spawn order
        done = all([self.wait(stage, max(0.0, deadline - time.perf_counter())) for stage in stages])
        if done and all(child.process.returncode == 0 for child in self.ahead.children):
            try:
                self.done.parent.mkdir(parents=True, exist_ok=True)
                self.done.touch()
            except OSError as exc:  # a later start spawns the children again: time, not harm
                log.warning("the kernel cache could not be stamped (%s)", exc)
        return done

    def close(self) -> None:
        self.ahead.close()


def describe(spec: dict) -> str:
    if spec["recipe"] in (ACTIVATION, TRACED_ACTIVATION):
        return f"{spec['function']}({', '.join(dtype for dtype, _ in spec['args'])})"
    return spec["dtype"]


def _name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


# ------------------------------------------------------------------ the children's side


def run_lookup(dtype: str) -> dict:
    """A gather of `dtype` rows by int32 ids, as an embedding looks up a prompt's tokens."""
    table = mx.zeros((4, 8), getattr(mx, dtype))
    rows = table[mx.array([[1, 2]], mx.int32)]
    mx.eval(rows)
    return {"rows": rows.shape[1]}


def run_row_writes(dtype: str) -> dict:
    """The KV pool's row writes (kernels/batching/kv_pool.py): `put_along_axis` of `dtype` rows
    by int32 slots."""
    from lockstep.kernels.batching.row_writes import write_rows_once

    write_rows_once(getattr(mx, dtype))
    return {}


def mlx_lm_activations():
    """`mlx_lm.models.activations` loaded alone, from its file: its package's import brings in
    transformers (seconds), and the functions' graphs, not their module, name the kernels."""
    import importlib.util
    from pathlib import Path

    package = importlib.util.find_spec("mlx_lm")  # located, not imported
    path = Path(package.submodule_search_locations[0]) / "models" / "activations.py"
    spec = importlib.util.spec_from_file_location("lockstep_warm_ahead_activations", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_activation(function: str, args: list, traced: bool) -> dict:
    """mlx-lm's activation `function` on arrays of the dtypes in `args`: called alone, as the
    warm-up's forward calls it, or traced inside a compiled call, as the compiled decode pass
    takes it (the fusion there is the activation's graph alone: matmuls, which do not fuse,
    surround it). Each is a kernel of its own."""
    f = getattr(mlx_lm_activations(), function)
    inputs = [mx.zeros(() if scalar else (1, 1, 8), getattr(mx, dtype)) for dtype, scalar in args]
    mx.eval(mx.compile(lambda *xs: f(*xs))(*inputs) if traced else f(*inputs))
    return {}


def run(spec: dict) -> dict:
    """A child's work: its recipe run; its seconds."""
    started = time.perf_counter()
    recipe = spec["recipe"]
    if recipe == LOOKUPS:
        made = run_lookup(spec["dtype"])
    elif recipe == ROW_WRITES:
        made = run_row_writes(spec["dtype"])
    elif recipe in (ACTIVATION, TRACED_ACTIVATION):
        made = run_activation(spec["function"], spec["args"], traced=recipe == TRACED_ACTIVATION)
    else:
        raise ValueError(f"no recipe {recipe!r}")
    return {"recipe": recipe, **made, "seconds": time.perf_counter() - started}


if __name__ == "__main__":
    json.dump(run(json.loads(sys.stdin.read())), sys.stdout)
