"""The model runner: owns the model and everything that runs it, and executes what the
scheduler describes.

It holds the loaded model, its batched (ragged) passes, the KV pool and the choice of
forms per pass (canonical forms only where a request asked for determinism, native
otherwise). `execute(SchedulerOutput) -> ModelRunnerOutput` runs one engine step's prompt
chunks and decode passes: for each pass it asks the requests' drafters for the drafts the
scheduler allowed, runs the pass (every device round trip: logits, every row's argmax, every
sampled request's sampling) and chooses each request's tokens (sample and compare), which it
returns as plain data. Nothing here decides who runs or how many drafts (the scheduler and
the request's policy) or what a token means (the request's state).

Decoding ahead (`Deployment.decode_ahead`, server/engine/runner/decode_ahead.py): after a compiled
decode pass the runner may build the next one on its tokens while the device still runs it,
and take that pass over in the next step.

One request run alone is this runner with one request: the solo paths (generate.py,
token_steps.drive, the bench and verify) use `forward_rows`, `new_cache` and
`prefill_cache`, which are exactly what the engine's passes run.
"""
from __future__ import annotations

import contextlib
import logging
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from lockstep.kernels.batching.compiled_pass import CompiledPasses, NotCompilable, unavailable_reason
from lockstep.kernels.batching.kv_pool import KVPool, is_pooled, written_kv
from lockstep.kernels.batching.ragged import enable_ragged, ragged_logits, ragged_problem, ragged_prompt_forward
from lockstep.kernels.invariance.layers import call_without_head, calls_in_blocks, native_forms
from lockstep.kernels.invariance.prefill import chunk_end, resume_at
from lockstep.server.engine.runner import decode_ahead
from lockstep.server.engine.runner.decode_ahead import AheadPass
from lockstep.server.engine.guarantee.deployment import Deployment, sampling_only_change
from lockstep.server.engine.runner.step_data import (DecodePass, ModelRunnerOutput, PassOutput, PassResult, PrefillResult,
                                              SampledTokens, ScheduledPass, SchedulerOutput)

log = logging.getLogger(__name__)

SOLO = "one request per pass"  # the batching problem of a runner made for one request


def forward(model, cache: list, tokens: list[int]) -> mx.array:
    """Logits for every position of `tokens`, appending them to `cache` (a plain model call)."""
    return model(mx.array(tokens)[None], cache=cache).squeeze(0)


def prompt_forward(model, cache: list, tokens: list[int]) -> None:
    """Append `tokens`' KV to `cache` without the output head: a prompt chunk's logits are
    never used, and the head (a vocab-wide matmul per row) is much of a chunk's cost."""
    call_without_head(model, mx.array(tokens)[None], cache)


def prompt_forms(states: list):
    """The forms a pass of these requests' target prompt chunks runs: the model's native ones
    where every request's prompt is to (`RequestState.native_prompt`), else the model's setting
    (`call_without_head`)."""
    native = bool(states) and all(getattr(state, "native_prompt", False) for state in states)
    return native_forms() if native else contextlib.nullcontext()


def check_device() -> None:
    """Raise where the device runs nothing any more: on CUDA an illegal memory access is sticky,
    and every call after it fails (the engine then ends, server/engine/engine.py)."""
    mx.eval(mx.zeros((1,)) + 1)
    mx.synchronize()


class ModelRunner:
    """`model`: a loaded mlx-lm model. `pool_tokens`: the KV pool's first size (None or
    a deployment without a pool: every request its own KVCache); `pool_max_tokens`: the most it
    may grow to (the KV budget). `batched` False: a runner for one request at a time (plain
    model calls, as a solo run makes them)."""

    def __init__(self, model, deployment: Deployment | None = None, *, pool_tokens: int | None = None,
                 pool_max_tokens: int | None = None, batched: bool = True):
        self.model = model
        self.deployment = deployment or Deployment()
        self.batching_problem = self._prepare_batching() if batched else SOLO
        self.kv_pool = None
        if self.deployment.kv_pool != "off" and self.batching_problem is None and pool_tokens:
            self.kv_pool = KVPool(self.model, pool_tokens, use_kernel=self.deployment.kv_pool == "kernel",
                                  max_capacity=pool_max_tokens)
        # Plain decode passes as compiled calls, where the pool runs its kernel and passes are
        # built whole (async_eval_layers hands parts of a pass over while it is built).
        self.compiled = None
        if (self.deployment.compiled_passes and not self.deployment.async_eval_layers
                and unavailable_reason(self.kv_pool) is None):
            self.compiled = CompiledPasses(self.model, self.kv_pool)
        self._ahead: AheadPass | None = None
        self.ahead_built = self.ahead_taken = self.ahead_dropped = 0  # passes decoded ahead; taken over; dropped

    @classmethod
    def as_engine_runs(cls, model, kv_pool: str = "off", pool_tokens: int = 4096) -> "ModelRunner":
        """A runner whose passes for one request are the engine's: ragged passes, over a KV pool
        when `kv_pool` is "kernel" or "reference" (pass-cost measurement, `bench --tasks`)."""
        return cls(model, Deployment(kv_pool=kv_pool), pool_tokens=pool_tokens)

    def _prepare_batching(self) -> str | None:
        """Patch the model for ragged passes; why not, when it cannot (one request per pass)."""
        problem = ragged_problem(self.model)
        if problem is None:
            enable_ragged(self.model)
        else:
            log.warning("requests are not batched into shared passes: %s", problem)
        return problem

    @property
    def batched(self) -> bool:
        return self.batching_problem is None

    def describe(self) -> dict:
        return {"batched": self.batched, "kv_pool": self.deployment.kv_pool if self.kv_pool is not None else "off",
                "compiled_passes": {"plain": self.compiled is not None,
                                    "deterministic": self.compiled is not None
                                    and self.deployment.guarantee.compiled_canonical_passes},
                "decode_ahead": self.compiled is not None and self.deployment.decode_ahead,
                **({"not_batched_because": self.batching_problem}
                   if self.batching_problem not in (None, SOLO) else {})}

    # ------------------------------------------------------------------------ caches

    def new_cache(self, tokens: int) -> list:
        """A request's KV: a range of the pool for `tokens`, or a fresh mlx-lm cache."""
        return self.kv_pool.allocate(tokens) if self.kv_pool is not None else make_prompt_cache(self.model)

    def release(self, cache: list | None) -> None:
        if self.kv_pool is not None and cache and is_pooled(cache):
            self.kv_pool.release(cache)

    # --------------------------------------------------------------- one request's pass

    def forward_rows(self, cache: list, rows: list[int]) -> mx.array:
        """Logits (len(rows), vocab) of one request's pass, as the engine runs it."""
        if self.batched:
            return ragged_logits(self.model, [(cache, rows)])
        return forward(self.model, cache, rows)

    def prefill_cache(self, cache: list, tokens: list[int], chunk: int | None = None):
        """Feed `tokens` past what `cache` holds, in chunks aligned to absolute positions (a
        generator: yields after each chunk). A prefix reused from the prefix cache then ends
        with the same KV as a cold prefill (kernels/invariance/prefill.py); a cached prefix
        ending mid-chunk is rewound to the grid point that chunk starts at, unless rows are
        canonical or the prompt may be cut anywhere."""
        chunk = chunk or self.deployment.prefill_chunk
        done = next((layer.offset for layer in cache if isinstance(getattr(layer, "offset", None), int)), 0)
        guarantee = self.deployment.guarantee
        start = resume_at(done, chunk, guarantee.canonical_rows, len(tokens), guarantee.prefill_split_rows)
        if start < done:
            trim_prompt_cache(cache, done - start)
        pos = start
        while pos < len(tokens):
            end = chunk_end(pos, len(tokens), chunk, split_rows=guarantee.prefill_split_rows)
            prompt_forward(self.model, cache, tokens[pos:end])
            mx.eval([c.state for c in cache])
            pos = end
            yield None

    # ---------------------------------------------------------------- an engine step

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        result = ModelRunnerOutput()
        for slot in output.prefill_alone:
            try:
                result.prefill_alone.append(self.prefill(slot.state))
            except Exception as exc:  # the scheduler fails this request; the others go on
                result.prefill_alone.append(exc)
        if output.prefill_shared:
            try:
                result.prefill_shared = self.prefill_shared([slot.state for slot in output.prefill_shared])
            except Exception as exc:
                result.prefill_shared = exc
        for scheduled in output.passes:
            try:
                result.passes.append(self.run_pass(scheduled, look_ahead=output.decode_ahead))
            except Exception as exc:
                result.passes.append(exc)
        if result.failed:
            check_device()  # the work failed alone, or the device fails everything from now on
        return result

    def run_pass(self, scheduled: ScheduledPass, look_ahead: bool = False) -> PassOutput:
        """Draft, run and sample one scheduled decode pass: each member's drafter proposes up
        to its k drafts, the pass runs [last token, *drafts] of every member (`decode`), and
        each member's tokens are chosen from its rows. A member whose drafting or sampling
        fails fails alone; one whose client left while drafting does not run."""
        started = time.perf_counter()
        members = [None] * len(scheduled.members)
        running = []  # (index, slot, rows, drafts)
        for i, member in enumerate(scheduled.members):
            state = member.slot.state
            try:
                drafts = state.source.propose(member.k)
            except Exception as exc:
                members[i] = exc
                continue
            if state.cancelled():
                continue  # no pass for nobody
            running.append((i, member.slot, [member.token, *drafts], drafts))
        if not running:
            return PassOutput(0, members)
        done = self.decode(DecodePass([(slot, rows) for _, slot, rows, _ in running]), look_ahead=look_ahead)
        for (i, slot, _, drafts), (begin, end), pending in zip(running, done.spans, done.sampled):
            try:
                steps = slot.state.source.verify(done.logits[begin:end], drafts, done.argmax[begin:end], pending)
            except Exception as exc:
                members[i] = exc
                continue
            members[i] = SampledTokens([step.sampled for step in steps], drafts)
        return PassOutput(sum(len(rows) for _, _, rows, _ in running), members, time.perf_counter() - started)

    def set_deployment(self, deployment: Deployment) -> None:
        """Run with `deployment` from now on; passes traced under the model's forms before are
        traced afresh (the guarantee's proofs installed the forms it serves with), unless only
        the batched-sampling proof's width changed (no pass depends on it)."""
        before, self.deployment = self.deployment, deployment
        if sampling_only_change(before, deployment):
            return
        self._drop_ahead()
        if self.compiled is not None:
            self.compiled.forget()

    def _compiled_logits(self, requests: list, canonical: bool) -> mx.array | None:
        """A pass's logits as one compiled call (a canonical one only where the guarantee proved
        compiled passes); None where it is built op by op."""
        if self.compiled is None or (canonical and not self.deployment.guarantee.compiled_canonical_passes):
            return None
        try:
            return self.compiled.logits(requests, canonical=canonical)
        except NotCompilable as exc:  # from now on every pass is built op by op
            log.warning("decode passes are not compiled: %s", exc)
            self.compiled = None
            return None

    def prefill(self, state) -> PrefillResult:
        """A request's next prompt chunk, in a pass of its own (target or draft model)."""
        step = state.next_prefill()
        if step.follow:
            return PrefillResult(0, step.model, follow=True)
        model = self.model if step.model == "target" else self.deployment.draft_model
        with prompt_forms([state] if step.model == "target" else []):
            prompt_forward(model, step.cache, step.tokens)
        mx.eval([c.state for c in step.cache])
        return PrefillResult(len(step.tokens), step.model)

    def prefill_shared(self, states: list) -> list[int]:
        """Each request's next target prompt chunk, all in one ragged pass."""
        chunks = [state.next_chunk() for state in states]
        # The pass's output too: a pipeline stage's hand-off hangs on it (a ragged pass's caches
        # have no KV array of their own to carry it, as one request's do).
        with prompt_forms(states):
            out = ragged_prompt_forward(self.model, [(state.cache, chunk) for state, chunk in zip(states, chunks)])
        mx.eval(out, written_kv([state.cache for state in states]))
        return [len(chunk) for chunk in chunks]

    def decode(self, decode_pass: DecodePass, look_ahead: bool = False) -> PassResult:
        """One decode pass over its members' rows (their caches advance): logits, every row's
        argmax and every sampled request's sampling, in one or two device round trips.
        `look_ahead`: the same requests are expected in one pass next step, so the next pass
        may be built now (`Deployment.decode_ahead`)."""
        members = [(slot.state, rows) for slot, rows in decode_pass.members]
        canonical = decode_pass.canonical
        ahead, self._ahead = self._ahead, None
        taken = ahead.rows_for(members, canonical) if ahead is not None else None
        if taken is not None:
            self.ahead_taken += 1
            decode_ahead.advance([state.cache for state, _ in members], 1)
            logits, argmax, compiled = ahead.logits, ahead.argmax, True
            spans = [(i, i + 1) for i in taken]
            sampled = [ahead.sampled[i] for i in taken]
        else:
            if ahead is not None:
                self.ahead_dropped += 1
            # Canonical passes may hold more rows than L (the ragged proof covered their widths):
            # each call of more than L rows then runs in blocks of at most L.
            with calls_in_blocks() if canonical else native_forms():
                if self.batched:
                    requests = [(state.cache, rows) for state, rows in members]
                    logits = self._compiled_logits(requests, canonical)
                    compiled = logits is not None
                    if logits is None:
                        logits = ragged_logits(self.model, requests, self.deployment.async_eval_layers)
                else:
                    (state, rows), = members
                    logits = self.forward_rows(state.cache, rows)
                    compiled = False
            argmax = mx.argmax(logits, axis=-1)  # greedy requests need nothing else
            spans, end = [], 0
            for _, rows in members:
                spans.append((end, end + len(rows)))
                end += len(rows)
            sampled = None
        # `compiled`: this pass ran compiled, which a canonical pass does only where the guarantee
        # proved compiled passes (and a pass taken over was built so).
        following = (decode_ahead.following(members, spans)
                     if look_ahead and compiled and self.deployment.decode_ahead else None)
        if following:
            if sampled is None:
                sampled = decode_ahead.presample(members, logits, spans)
            if sampled is not None:
                self._ahead = decode_ahead.submit_next(self.compiled, following, canonical, argmax, sampled)
                self.ahead_built += self._ahead is not None
                if self._ahead is not None:
                    for _, state, _ in following:  # their next pass verifies no drafts: it takes this one over
                        state.row_built_ahead()
        mx.eval(logits, argmax)
        try:
            if sampled is None:
                sampled = decode_ahead.presample_pass(members, logits, spans)
            mx.eval([x for s in sampled if s is not None for x in s.arrays])
        except Exception:  # each request then samples (and fails, if it must) on its own
            log.exception("batched sampling failed")
            sampled = [None] * len(members)
        return PassResult(logits, argmax.tolist(), sampled, spans)

    def _drop_ahead(self) -> None:
        if self._ahead is not None:
            self._ahead = None
            self.ahead_dropped += 1
