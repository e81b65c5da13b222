"""A deployment's decoding settings: what `lockstep serve` was started with, and the
guarantee its startup proofs established (`guarantee`: server/engine/guarantee/guarantee.py decides it,
once). Requests read it through their plan (server/engine/guarantee/decode_plan.py), nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from lockstep.server.engine.guarantee.guarantee import Guarantee, decide_guarantee

# Drafts proposed in one engine step (a draft model runs k passes in it), so k bounds how
# long one request can hold the engine: a server maximum, `--max-draft-tokens`.
MAX_DRAFT_TOKENS = 16
# Prompt tokens one prefill chunk holds (`--prefill-chunk`): a long prompt holds the engine a
# chunk at a time, and chunks end on a grid of absolute positions (kernels/invariance/prefill.py).
PREFILL_CHUNK = 512
# On the CPU, plain prompts (no determinism to keep) go in chunks of at most this many tokens:
# a 512-token chunk holds the engine ~3 s there, and OpenBLAS prefills 64-row chunks about as
# fast per token (docs/BENCHMARKS.md, issue 54), so a short request beside a long prompt waits
# a fraction of that per step. Their KV then differs in bits from canonical chunks' (prefix_cache.py).
CPU_PLAIN_PREFILL_CHUNK = 64
# `--prefill-chunk`'s default on the CPU: a deterministic prompt's chunk keeps this width (its
# bits depend on it), and a 512-token one held a short request beside it for 3-5 s there; a
# 128-token one prefills about as fast per token (docs/BENCHMARKS.md, issue 54).
CPU_PREFILL_CHUNK = 128


@dataclass(frozen=True)
class Deployment:
    """Per-deployment decoding settings (from `lockstep serve` flags and the startup proofs)."""

    # L and what the startup proofs established, decided once (server/engine/guarantee/guarantee.py)
    # and read from here only
    guarantee: Guarantee = Guarantee()
    speculative: str = "none"  # default method for requests that do not choose
    num_draft_tokens: int = 4  # default k
    max_draft_tokens: int = MAX_DRAFT_TOKENS  # the largest k any request may use
    draft_model: object | None = None
    draft_name: str | None = None
    # The draft model is loaded after serving started (`serve`: server/startup_work.py DraftWork);
    # meanwhile requests that would draft from it decode without drafts. draft_problem: why
    # it could not be loaded.
    draft_loading: bool = False
    draft_problem: str = ""
    # Why the deployment does not draft from its draft model although one was asked for ("":
    # it does): drafting was measured not to pay on this backend (server/engine/decoding/draft_costs.py),
    # or `default-quantized` has no form cheaper than the target here. Requests asking for
    # drafts from it decode without them, with this as their note.
    draft_refusal: str = ""
    # Measured at startup (draft_costs.py): one draft-model pass in target decode passes (what
    # adaptive speculation weighs per proposed token; None: estimated from the models' depths),
    # and the draft prompt tokens one prefill chunk may hold within its time budget (0: the
    # prefill chunk).
    draft_step_cost: float | None = None
    draft_prefill_tokens: int = 0
    draft_costs: object | None = None  # the measurement (draft_costs.DraftCosts), for /v1/models
    # Adaptive speculation: k chosen per step from the request's own acceptance, up to the
    # plan's k (server/engine/decoding/speculative.py AdaptiveDraftLength). pass_costs[w - 1] is the
    # measured cost of a target pass of w rows (measure_pass_costs); None: linear in w.
    adaptive_draft_tokens: bool = False
    # Without adaptive speculation, a cheap drafter's drafts stop being verified after a miss
    # until one agrees again (speculative.py DraftBackoff); off: k drafts every step.
    draft_backoff: bool = True
    pass_costs: tuple[float, ...] | None = None
    prefill_chunk: int = PREFILL_CHUNK
    # Tokens a plain prompt's chunk holds (0: prefill_chunk): not in the fingerprint, since a
    # plain request's bits are not guaranteed; deterministic prompts keep prefill_chunk.
    plain_prefill_chunk: int = 0
    # Plain prompts' chunks run the model's native forms, not the guarantee's setting (on CUDA
    # their wide 4-bit calls then take kernels/custom/dequantized_rows.py, about twice as fast):
    # their KV then differs in bits from canonical chunks', which the prefix cache keeps apart.
    # Not in the fingerprint either; server/runtime.py decides it (split_rows.prompt_chunks_native).
    plain_prompt_native: bool = False
    # The model's caches can be rewound past rejected drafts (recurrent state cannot: then no
    # speculation, server/runtime.py decides it from the model's own caches).
    speculation: bool = True
    # Why not, when `speculation` is off: `rewind_refusal`'s words for the model's kind of state.
    speculation_refusal: str = ""
    # Requests' KV in one shared pool, one attention launch per layer for a whole pass
    # (kernels/batching/kv_pool.py): "kernel" (the GPU kernel), "reference" (one MLX attention call per
    # row, where there is no kernel) or "off" (each request its own KVCache).
    kv_pool: str = "off"
    # Decode passes start evaluating every this many layers while the rest is built
    # (kernels/batching/ragged.py ragged_logits); 0: built whole, then evaluated.
    async_eval_layers: int = 0
    # Plain decode passes over the pool's kernel as one compiled call per row count
    # (kernels/batching/compiled_pass.py); `serve --compiled-passes off` builds them op by op.
    compiled_passes: bool = True
    # A compiled decode pass is followed at once by the next one, built on its tokens while the
    # device runs it, where every member's next row is known there (server/engine/runner/decode_ahead.py);
    # `serve --decode-ahead off` runs one pass at a time.
    decode_ahead: bool = True
    fingerprint: str = ""
    model_digest: str = ""  # sha256 of the weight files' contents (server/fingerprint.py weights_digest)


def sampling_only_change(before: Deployment, after: Deployment) -> bool:
    """Whether `after` differs from `before` in the batched-sampling proof's width and in nothing
    else (server/startup_work.py SamplingWork): how many deterministic rows one sampling call may
    hold, never a row's bits or the passes that make its logits. An unchanged deployment is not
    such a change: startup work may have changed the model in place (the audit's workarounds)."""
    width = before.guarantee.sampling_rows
    return (after.guarantee.sampling_rows != width
            and replace(after, guarantee=replace(after.guarantee, sampling_rows=width)) == before)


def proven_deployment(model, invariance, *, kv_pool: str = "off", proofs=None, pass_rows: int | None = None,
                      **settings) -> Deployment:
    """A `Deployment` for `model` whose guarantee is `decide_guarantee`'s for the installed
    `invariance` (the ragged proof made there); `settings`: the Deployment's other fields. A
    model with per-request state gets no speculation, whatever `settings` say (its state
    cannot be rewound past rejected drafts)."""
    from mlx_lm.models.cache import make_prompt_cache

    from lockstep.kernels.invariance.cache_check import per_request_state

    guarantee = decide_guarantee(model, invariance, kv_pool, proofs, pass_rows,
                                 compiled=settings.get("compiled_passes", Deployment.compiled_passes),
                                 prefill_chunk=settings.get("prefill_chunk", Deployment.prefill_chunk))
    caches = make_prompt_cache(model)
    if per_request_state(caches) is not None:
        settings["speculation"] = False
        settings["speculation_refusal"] = rewind_refusal(caches)
    return Deployment(guarantee=guarantee, kv_pool=kv_pool, **settings)


def rewind_refusal(caches) -> str | None:
    """Why a model with these caches (mlx-lm's, one per layer) cannot speculate, worded for
    its kind of state, or None when every cache is a plain KV cache (cut back after rejected
    drafts)."""
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    if all(type(c) is KVCache for c in caches):
        return None
    recurrent = [i for i, c in enumerate(caches) if isinstance(c, ArraysCache)]
    sliding = [i for i, c in enumerate(caches) if isinstance(c, RotatingKVCache)]
    attention = [i for i, c in enumerate(caches) if isinstance(c, (KVCache, RotatingKVCache))]
    if recurrent and attention:
        return (f"this hybrid model's recurrent or conv layers (layer {recurrent[0]}: {type(caches[recurrent[0]]).__name__}) "
                "rewrite their state in place each token, so it cannot be rewound past rejected drafts")
    if recurrent:
        return (f"this recurrent model's state ({type(caches[recurrent[0]]).__name__}) is rewritten in place "
                "each token, so it cannot be rewound past rejected drafts")
    if sliding:
        return (f"this model's sliding-window attention (layer {sliding[0]}: RotatingKVCache) overwrites "
                "its oldest entries once the window is full, so it cannot be rewound past rejected drafts")
    kinds = sorted({type(c).__name__ for c in caches if type(c) is not KVCache})
    return f"this model's caches ({', '.join(kinds)}) cannot be rewound past rejected drafts"
