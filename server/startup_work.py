"""The startup work left for the engine thread once serving started (`Runtime.pending`):
the kernel audit's later stages (`AuditWork`), the guarantee's proofs (`GuaranteeWork`), the
draft model (`DraftWork`) and the batched-sampling proof (`SamplingWork`). Each `run()`s on
the engine thread and then `settle()`s."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from lockstep.server.draft_assessment import assess_draft
from lockstep.server.engine.guarantee.deployment import Deployment
from lockstep.server.engine.guarantee.guarantee import Guarantee
from lockstep.server.engine.guarantee.guarantee_state import REFUSED, settled_state
from lockstep.server.model_loading import load_draft, workarounds_label
from lockstep.server.phases import Phases

log = logging.getLogger("lockstep.runtime")


def deployment_fingerprint(loaded, transform: str, guarantee: Guarantee, options, kv_pool: str) -> str:
    """The deployment's `system_fingerprint`: what it serves, how, and under which guarantee."""
    from lockstep.kernels import cpu_blas
    from lockstep.server.fingerprint import system_fingerprint

    return system_fingerprint(loaded.path, transform=transform, strategy=guarantee.strategy, limit=guarantee.call_rows,
                              blas=cpu_blas.describe(), prefill_chunk=options.prefill_chunk, kv_pool=kv_pool)


@dataclass
class GuaranteeWork:
    """What proves a deployment's guarantee: the self-test (installing the proven forms), the
    kernel builds, the pass costs and the ragged proof; then the deployment that carries it.

    Run before serving (`build_runtime`), or by the engine thread after serving started
    (`serve`: plain passes run between the proofs' steps, kernels/proof_steps.py), so a fresh
    machine answers plain requests while it proves. Deterministic requests wait for it
    (server/engine/guarantee/guarantee_state.py)."""

    runtime: object  # server.runtime.Runtime
    options: object  # server.runtime.Options
    proofs: object  # kernels.invariance.selftest.ProofCache
    # Set by the engine that runs this work: serve with a deployment from now on (engine thread).
    # A first ragged proof then puts the guarantee in force for the widths proven so far.
    install: Callable[[Deployment], None] | None = None

    def _proven_widths(self, invariance, pass_costs) -> Callable[[int], None]:
        """What a first ragged proof calls once passes of 1..w rows are proven: from w = L on, the
        guarantee is in force for deterministic passes of at most w rows (each width is proven on
        its own, so those stay proven whatever a wider one shows), its prompt chunks alone and its
        passes op by op until the shared-prefill and compiled proofs that follow. A proof resumed
        from an interrupted one calls it first with the widths kept: those are in force at once."""
        runtime, options = self.runtime, self.options
        installed = []

        def proven(width: int) -> None:
            if self.install is None or width < invariance.call_rows or (width % invariance.call_rows and installed):
                return  # then at multiples of L: each install retraces the compiled passes
            installed.append(width)
            runtime.invariance = invariance
            guarantee = dataclasses.replace(Guarantee.installed(invariance), shared_passes=True, pass_rows=width)
            runtime.deployment = dataclasses.replace(
                runtime.deployment, guarantee=guarantee, pass_costs=pass_costs,
                fingerprint=deployment_fingerprint(runtime.loaded, runtime.transform, guarantee, options,
                                         runtime.deployment.kv_pool))
            self.install(runtime.deployment)
            if not runtime.guarantee.settled:
                runtime.guarantee.settle(settled_state(runtime.deployment))
            log.info("guarantee in force for passes of 1..%d rows; the ragged proof goes on", width)
        return proven

    def run(self) -> Deployment:
        from lockstep.kernels.batching.ragged_selftest import per_request_self_test
        from lockstep.kernels.invariance import set_batch_invariant_limit
        from lockstep.server.engine.guarantee.guarantee import decide_guarantee

        runtime, options, timings = self.runtime, self.options, self.runtime.timings
        model, kv_pool = runtime.loaded.model, runtime.deployment.kv_pool
        if options.batch_invariant_limit and not runtime.audited.complete:
            # the proofs call the layers at every width up to L
            raise RuntimeError("the kernel audit passed only calls of "
                               f"{runtime.audited.describe()['audited_rows']} rows")
        started = time.perf_counter()
        with timings.timed("self_test"):
            invariance = set_batch_invariant_limit(model, options.batch_invariant_limit,
                                             options.invariant_strategy, proof_cache=self.proofs,
                                             per_request_proof=per_request_self_test,
                                             expert_pass_rows=options.max_batch_rows)
        if options.batch_invariant_limit:
            (log.info if invariance.guaranteed else log.warning)(
                "batch invariance L=%d strategy=%s guaranteed=%s (%s)",
                invariance.call_rows, invariance.strategy, invariance.guaranteed, invariance.reason)
        if invariance.guaranteed:
            from lockstep.kernels.invariance.warmup import build_kernels

            with timings.timed("build_kernels"):  # compiled now, not during the first passes
                build_kernels(model, invariance.call_rows)
        pass_costs = None
        if options.adaptive_speculation and runtime.deployment.speculation:
            from lockstep.server.engine.runner.model_runner import ModelRunner
            from lockstep.server.engine.decoding.speculative import measure_pass_costs

            widest = options.max_draft_tokens + 1
            if invariance.guaranteed:
                widest = max(widest, invariance.call_rows)
            with timings.timed("pass_costs"):  # what a verification pass of w rows costs in the engine
                pass_costs = tuple(measure_pass_costs(model, widest,
                                                      runner=ModelRunner.as_engine_runs(model, kv_pool)))
        # the deployment's guarantee, decided here only (its ragged proof timed where one is made)
        with timings.timed("ragged_proof") if invariance.guaranteed else contextlib.nullcontext():
            guarantee = decide_guarantee(model, invariance, kv_pool, self.proofs, options.max_batch_rows,
                                         shared_prefill=options.prepare_model is None,
                                         compiled=runtime.deployment.compiled_passes,
                                         on_width=self._proven_widths(invariance, pass_costs),
                                         prefill_chunk=runtime.deployment.prefill_chunk)
        deployment = dataclasses.replace(
            runtime.deployment, guarantee=guarantee, pass_costs=pass_costs,
            fingerprint=deployment_fingerprint(runtime.loaded, runtime.transform, guarantee, options, kv_pool))
        runtime.invariance, runtime.deployment = invariance, deployment
        runtime.guarantee_seconds = time.perf_counter() - started
        return deployment

    def settle(self) -> None:
        """Say the proofs' outcome to whoever waits for it: once the deployment that carries it
        is the one requests are planned with."""
        guarantee, timings = self.runtime.deployment.guarantee, self.runtime.timings
        self.runtime.guarantee.settle(settled_state(self.runtime.deployment),
                                      "" if guarantee.guaranteed else guarantee.reason)
        if self.runtime.guarantee_seconds is not None and guarantee.call_rows:
            proofs = Phases({k: v for k, v in timings.items() if k in PROOF_PHASES})
            proofs.compile = {k: v for k, v in timings.compile.items() if k in PROOF_PHASES}
            log.info("guarantee %s after %.1fs of proofs: %s", self.runtime.guarantee.state.replace("_", " "),
                     self.runtime.guarantee_seconds, proofs.line())


PROOF_PHASES = ("self_test", "build_kernels", "pass_costs", "ragged_proof")


@dataclass
class SamplingWork:
    """The batched-sampling proof (server/engine/decoding/sampling_proof.py) for the widest pass
    the guarantee lets deterministic rows share, on logits of the served model's vocabulary and
    dtype (`Runtime.logits_format`, seen at the warm-up); its width becomes the guarantee's
    `sampling_rows`. Until it has run, deterministic rows sample alone (the same bits, one
    sampling a row), so it runs after the guarantee's proofs and the draft model, serving
    between its widths. Nothing to prove where deterministic rows never share a pass."""

    runtime: object  # server.runtime.Runtime
    proofs: object  # kernels.invariance.selftest.ProofCache: where the verdict is kept
    proof: object = None  # the SamplingProof, once run (None: nothing to prove)

    def run(self) -> Deployment:
        from lockstep.server.engine.decoding.sampling_proof import prove_batched_sampling

        runtime = self.runtime
        guarantee = runtime.deployment.guarantee
        if not (guarantee.guaranteed and guarantee.shared_passes) or runtime.logits_format is None:
            return runtime.deployment
        vocab, dtype = runtime.logits_format
        with runtime.timings.timed("sampling_proof"):
            self.proof = prove_batched_sampling(vocab, dtype, guarantee.pass_rows, proof_cache=self.proofs)
        runtime.deployment = dataclasses.replace(
            runtime.deployment, guarantee=dataclasses.replace(guarantee, sampling_rows=self.proof.rows))
        return runtime.deployment

    def settle(self) -> None:
        if self.proof is not None:
            (log.info if self.proof.rows >= 2 else log.warning)(
                "%s%s", self.proof.describe(),
                " (re-used from the verdict cache)" if self.proof.cached else f" ({self.proof.seconds:.1f} s)")


def audit_stage_when_compiled(model, stage: str, ahead, *, fresh: bool):
    """The audit of one deferred `stage` of `model` on the engine thread, each configuration's
    workaround swapped in as soon as its verdict is in; first, where children compile the
    stage's kernels (`ahead`: kernels/audit/compile_ahead.py), it waits for them, serving the
    requests at audited widths between polls."""
    from lockstep.kernels.audit import audit_model, audit_verdict_cache, patch_config
    from lockstep.kernels.audit.report import OK, REFUSED as REFUSED_VERDICT
    from lockstep.kernels.proof_steps import step_done

    def patch(result, layers) -> None:
        if result.verdict not in (OK, REFUSED_VERDICT):
            patch_config(model, result.config, layers, result.verdict)
            mx.eval(model.parameters())

    while ahead is not None and not ahead.ready(stage, timeout=0.05):
        step_done()
    return audit_model(model, cache=audit_verdict_cache(), fresh=fresh, stages=(stage,), on_result=patch)


@dataclass
class AuditWork:
    """One stage of the kernel audit left when serving started (kernels/audit/widths.py: calls
    of 2..32 rows; on CUDA of 33 rows and more too), run by the engine thread between passes
    before the guarantee's proofs (they call the layers at those widths). Where children compile
    the stage's kernels (`Runtime.compile_ahead`), it first waits for them, serving meanwhile.
    Each configuration's workaround is swapped in as soon as its verdict is in, before any pass
    runs; the stage's widths become audited (the scheduler's gate) only once every
    configuration passed them. A refusal leaves them unaudited: serving goes on at the audited
    widths, and the guarantee is refused."""

    runtime: object  # server.runtime.Runtime
    options: object  # server.runtime.Options
    proofs: object  # kernels.invariance.selftest.ProofCache: its model identity names the workarounds
    stage: str

    def run(self) -> Deployment:
        from lockstep.kernels.audit import merge_reports

        runtime = self.runtime
        first = runtime.audit
        with runtime.timings.timed(f"audit_{self.stage}_after_start"):
            later = audit_stage_when_compiled(runtime.loaded.model, self.stage, runtime.compile_ahead,
                                              fresh=self.options.audit == "fresh")
        report = merge_reports(first, later)
        report.deferred = first.deferred if report.refused else tuple(s for s in first.deferred if s != self.stage)
        if report.refused:
            log.error("kernel audit: %s; serving goes on with calls of %s rows only",
                      "; ".join(f"{c.config.label()} refused" for c in report.refused),
                      runtime.audited.describe()["audited_rows"])
        transform = runtime.transform
        old, new = workarounds_label(first), workarounds_label(report)
        transform = transform.replace(old, new) if old else transform + new
        runtime.audit, runtime.transform = report, transform
        self.proofs.model_identity["transform"] = transform
        runtime.deployment = dataclasses.replace(runtime.deployment, fingerprint=deployment_fingerprint(
            runtime.loaded, transform, runtime.deployment.guarantee, self.options, runtime.deployment.kv_pool))
        return runtime.deployment

    def settle(self) -> None:
        runtime = self.runtime
        if runtime.audit.refused:
            if not self.options.batch_invariant_limit and not runtime.guarantee.settled:
                runtime.guarantee.settle(REFUSED, "the kernel audit refused calls of several rows")
            return
        runtime.audited.add(self.stage)
        log.info("kernel audit (%s) complete (%.1fs on the engine thread after serving started): "
                 "calls of %s rows audited", self.stage,
                 runtime.timings.get(f"audit_{self.stage}_after_start", 0.0),
                 runtime.audited.describe()["audited_rows"])
        if runtime.audited.complete and not self.options.batch_invariant_limit:
            runtime.guarantee.settle(settled_state(runtime.deployment))


@dataclass
class DraftWork:
    """Loading the draft model (load, quantize, audit) after serving started: the engine runs it
    after the guarantee's proofs, serving between the audit's configurations. Until it is done,
    requests that would draft from it decode without drafts (the same tokens for deterministic
    requests: drafts change the speed only). Where MLX compiles its quantized kernels at first
    use (CUDA: kernels/audit/compile_ahead.py), the draft's wide and narrow calls are audited as
    the target's are: once children have compiled their kernels, serving meanwhile."""

    runtime: object  # server.runtime.Runtime
    options: object  # server.runtime.Options

    def run(self) -> Deployment:
        runtime = self.runtime
        try:
            draft, name = self._load()
            runtime.deployment = dataclasses.replace(runtime.deployment, draft_model=draft, draft_name=name)
            if self.options.draft_where_it_pays:
                runtime.deployment = assess_draft(runtime, self.options)
            deployment = dataclasses.replace(runtime.deployment, draft_loading=False)
        except Exception as exc:  # a draft that cannot draft: serving goes on without one
            log.error("--draft-model %s not loaded: %s", self.options.draft_model, exc)
            deployment = dataclasses.replace(runtime.deployment, draft_loading=False,
                                             draft_problem=f"{type(exc).__name__}: {exc}")
        runtime.deployment = deployment
        return deployment

    def _load(self):
        """(draft model, name), audited whole; where compiling ahead pays, its deferred stages
        audited once their kernels are compiled (ModelError: a configuration refused)."""
        from lockstep.kernels.audit import compile_ahead, merge_reports, raise_if_refused
        from lockstep.kernels.audit.widths import deferred_stages
        from lockstep.kernels.backend_kind import backend_kind

        backend = backend_kind()
        defer = deferred_stages(backend) if compile_ahead.pays(backend) else ()
        draft, name, report = load_draft(self.options, self.runtime.loaded, self.runtime.timings, defer=defer)
        if report is None or not report.deferred:
            return draft, name
        with self.runtime.timings.timed("draft_audit_after_compiles"):
            ahead, stages = compile_ahead.CompileAhead.for_report(draft, report), report.deferred
            try:
                for stage in stages:
                    report = merge_reports(report, audit_stage_when_compiled(
                        draft, stage, ahead, fresh=self.options.audit == "fresh"))
                    raise_if_refused(report)
            finally:
                if ahead is not None:
                    ahead.close()
        return draft, name

    def settle(self) -> None:
        if self.runtime.deployment.draft_model is not None and not self.runtime.deployment.draft_refusal:
            log.info("draft model %s loaded: requests draft from it", self.runtime.deployment.draft_name)
