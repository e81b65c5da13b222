"""The kernels a first answer takes, compiled ahead in child processes while the server starts.

On CUDA, MLX compiles a kernel the first time a call takes it (NVRTC, then the driver; about
4 s each on an H100 on an empty kernel cache), one after another in a process. A fresh start's
first answer takes a handful of them in turn: the embedding's lookups (in the audit, then the
warm-up), the MLP's fused activation (the warm-up), the KV pool's row writes (the engine's
construction) and the compiled decode pass (the first request). Each is one recipe here, run
by a child of its own from the moment the model is loaded, all at once:

    ahead = WarmAhead.start(loaded, options)       # after the load (and any quantization)
    ahead.wait(LOOKUPS)                            # before the audit's lookups
    ahead.wait_all()                               # before the warm-up: the rest

The children work on what takes the same kernels as the served model, not on the model: the
lookups on small arrays of its embedding's dtypes, the passes on a one-layer copy of it whose
embedding looks nothing up (its lookups are the lookup children's). Their kernels reach MLX's
cache as the audit's compile-ahead children's do (kernels/audit/compile_ahead.py); they judge
nothing, and a child that fails or is late costs only the time (the parent compiles what it
still lacks itself).
"""
from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger(__name__)

LOOKUPS, ROW_WRITES, FORWARD, FIRST_REQUEST = "lookups", "row writes", "forward", "first request"
# How long the parent waits for a recipe's children before compiling what it lacks itself.
WAIT_S = 60.0


def lookup_dtypes(model) -> list[str]:
    """The dtypes the model's embedding lookups gather (a quantized embedding's packed weights,
    scales and biases; a plain one's weight), by name."""
    found = set()
    for _, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.QuantizedEmbedding)):
            for name in ("weight", "scales", "biases"):
                if name in module:
                    found.add(str(module[name].dtype).rsplit(".", 1)[-1])
    return sorted(found)


def recipes(loaded, options) -> list[tuple[str, dict]]:
    """(stage, spec) of each child for `loaded` served with `options` (server.runtime.Options)."""
    from lockstep.kernels.batching.kv_pool import kv_dtypes

    model_spec = {"path": str(loaded.path), "quantize": options.quantize, "q_bits": options.q_bits,
                  "q_group_size": options.q_group_size, "fuse_projections": options.fuse_projections}
    kv = sorted(str(d).rsplit(".", 1)[-1] for d in kv_dtypes(loaded.model))
    return ([(LOOKUPS, {"recipe": LOOKUPS, "dtype": d}) for d in lookup_dtypes(loaded.model)]
            + [(ROW_WRITES, {"recipe": ROW_WRITES, "dtype": d}) for d in kv]
            + [(FORWARD, {"recipe": FORWARD, **model_spec}),
               (FIRST_REQUEST, {"recipe": FIRST_REQUEST, **model_spec, "kv_pool": options.kv_pool,
                                "compiled_passes": options.compiled_passes, "decode_ahead": options.decode_ahead,
                                "async_eval_layers": options.async_eval_layers})])


def stamp(jobs: list[tuple[str, dict]]) -> Path:
    """The file in MLX's kernel cache that says these recipes' kernels were compiled into it (it
    goes with the cache when the cache is cleared: a reboot's temporary directory)."""
    from lockstep.kernels.audit.compile_ahead import kernel_cache_dir

    key = hashlib.sha256(json.dumps(jobs, sort_keys=True).encode()).hexdigest()[:16]
    return kernel_cache_dir() / f"lockstep-first-answer-{key}.done"


class WarmAhead:
    """The children compiling a first answer's kernels; `wait(stage)` publishes them."""

    def __init__(self, ahead, done: Path):
        self.ahead = ahead  # a kernels.audit.compile_ahead.CompileAhead over the children
        self.done = done  # stamped once every child has compiled its recipe

    @staticmethod
    def needed(loaded, options) -> bool:
        """Whether this cache lacks a first answer's kernels for `loaded` served with `options`."""
        return not stamp(recipes(loaded, options)).exists()

    @classmethod
    def start(cls, loaded, options, *, python: str = sys.executable) -> WarmAhead:
        from lockstep.kernels.audit.compile_ahead import CompileAhead, kernel_cache_dir, spawn_child

        jobs = recipes(loaded, options)
        children = [spawn_child(stage, __name__, spec, what=spec.get("dtype", "one layer"), python=python)
                    for stage, spec in jobs]
        log.info("compiling ahead the first answer's kernels in %d child processes (%s)", len(children),
                 ", ".join(f"{c.stage} {c.what}" for c in children))
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
        done = all([self.wait(stage, max(0.0, deadline - time.perf_counter()))
                    for stage in (LOOKUPS, ROW_WRITES, FORWARD, FIRST_REQUEST)])
        if done and all(child.process.returncode == 0 for child in self.ahead.children):
            self.done.parent.mkdir(parents=True, exist_ok=True)
            self.done.touch()
        return done

    def close(self) -> None:
        self.ahead.close()


# ------------------------------------------------------------------ the children's side


def _dtype(name: str):
    return getattr(mx, name)


def run_lookup(dtype: str) -> dict:
    """A gather of `dtype` rows by int32 ids, as an embedding looks up a prompt's tokens."""
    table = mx.zeros((4, 8), _dtype(dtype))
    rows = table[mx.array([[1, 2]], mx.int32)]
    mx.eval(rows)
    return {"rows": rows.shape[1], "dtype": dtype}


def run_row_writes(dtype: str) -> dict:
    from lockstep.kernels.batching.kv_pool import build_row_writes

    build_row_writes(_dtype(dtype))
    return {"dtype": dtype}


def keep_first_layer(model) -> None:
    """Cut `model` to its first decoder layer, in place (the list `model.layers` returns)."""
    layers = model.layers
    for _, module in model.named_modules():
        for name, child in list(module.items()):
            if child is layers:
                setattr(module, name, layers[:1])
                return
    raise ValueError("the model's layer list was not found among its modules")


class NoLookup(nn.Module):
    """An embedding's stand-in that looks nothing up: zeros of its output's shape and dtype (the
    lookups' kernels are the lookup children's); `as_linear` is the embedding's (a tied head)."""

    def __init__(self, embedding):
        super().__init__()
        self.embedding = embedding
        out = embedding(mx.array([[0]], mx.int32))  # shape and dtype only: nothing evaluated
        self.dims, self.out_dtype = out.shape[-1], out.dtype

    def __call__(self, ids):
        return mx.zeros((*ids.shape, self.dims), self.out_dtype)

    def as_linear(self, x):
        return self.embedding.as_linear(x)


def one_layer_copy(spec: dict):
    """The served model's first layer, head and embedding (its lookups stood in for) from its
    directory, loaded lazily, transformed as the server transforms it."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(spec["path"]), lazy=True)
    keep_first_layer(model)
    if spec.get("quantize"):
        from lockstep.models.quantize import quantize_model_in_memory

        quantize_model_in_memory(model, None, spec["quantize"], spec.get("q_bits"), spec.get("q_group_size"),
                                 progress=False)
    if spec.get("fuse_projections"):
        from lockstep.models.fused_projections import fuse_projections

        fuse_projections(model)
    for _, module in model.named_modules():
        for name, child in list(module.items()):
            if isinstance(child, (nn.Embedding, nn.QuantizedEmbedding)):
                setattr(module, name, NoLookup(child))
    mx.eval(model.parameters())
    return model


def run_forward(spec: dict) -> dict:
    """The warm-up's pass (server/runtime.py): one token through mlx-lm's own forward."""
    from mlx_lm.models.cache import make_prompt_cache

    model = one_layer_copy(spec)
    logits = model(mx.array([[1]], mx.int32), cache=make_prompt_cache(model))
    mx.eval(logits)
    return {"layers": len(model.layers), "logits": list(logits.shape)}


def run_first_request(spec: dict) -> dict:
    """A first request's decode passes on the engine's runner, greedy and sampled: a one-token
    prompt, so no prefill (the prompt's one-row passes take the forward child's kernels)."""
    from mlx_lm.utils import load_tokenizer

    from lockstep.kernels.batching import kv_pool
    from lockstep.kernels.batching.pool_mode import pool_mode
    from lockstep.models.load import LoadedModel
    from lockstep.server.engine.decoding.request_state import GenerationRequest
    from lockstep.server.engine.decoding.sampling import SamplingParams
    from lockstep.server.engine.generate import generate
    from lockstep.server.engine.guarantee.deployment import Deployment
    from lockstep.server.engine.runner.model_runner import ModelRunner

    model = one_layer_copy(spec)
    path = Path(spec["path"])
    loaded = LoadedModel(model=model, tokenizer=load_tokenizer(path), path=path, name="warm-ahead",
                         context_length=4096)
    deployment = Deployment(kv_pool=pool_mode(model, spec["kv_pool"]), compiled_passes=spec["compiled_passes"],
                            decode_ahead=spec["decode_ahead"], async_eval_layers=spec["async_eval_layers"],
                            prefill_chunk=1, plain_prefill_chunk=1)
    kv_pool.KVPool._build_row_writes = lambda self: None  # the row-writes children compile those
    runner = ModelRunner(model, deployment, pool_tokens=64)
    tokens = []
    for sampling in (SamplingParams(temperature=0.0, seed=0), SamplingParams(seed=0)):
        deltas = [d for d in generate(loaded, GenerationRequest([1], 2, sampling), deployment=deployment,
                                      runner=runner) if d is not None]
        tokens.append(deltas[-1].completion_tokens)
    return {"layers": len(model.layers), "kv_pool": deployment.kv_pool, "tokens": tokens}


def run(spec: dict) -> dict:
    """A child's work: its recipe run; what it made, and its seconds."""
    started = time.perf_counter()
    recipe = spec["recipe"]
    if recipe == LOOKUPS:
        made = run_lookup(spec["dtype"])
    elif recipe == ROW_WRITES:
        made = run_row_writes(spec["dtype"])
    elif recipe == FORWARD:
        made = run_forward(spec)
    elif recipe == FIRST_REQUEST:
        made = run_first_request(spec)
    else:
        raise ValueError(f"no recipe {recipe!r}")
    return {"recipe": recipe, **made, "seconds": time.perf_counter() - started}


if __name__ == "__main__":
    json.dump(run(json.loads(sys.stdin.read())), sys.stdout)
