"""Batch-invariant execution: one call per deployment makes a loaded mlx-lm model give every
row of a forward pass of M <= L rows the bits it gets alone (M = 1, same KV cache), so
speculative verification and batched requests return exactly what plain decoding does.

    invariance = set_batch_invariant_limit(model, 8)      # strategy="auto": proven, fastest
    invariance.guaranteed, invariance.strategy, invariance.reason
    set_batch_invariant_limit(model, 0)             # native again

Every linear (dense, quantized in any mode, the tied embedding head), MoE expert block
(gather_mm / gather_qmm) and attention block with M <= L rows, M = 1 decode included, runs
one canonical form (kernels/invariance/ops.py, layers.py); M > L (long prefill) runs the
native fast path. The form is chosen per backend by proof: each candidate is installed and
self-tested bitwise on this model (kernels/invariance/selftest.py); "auto" keeps the fastest
that passes, and falls back to rowwise, the safest, unclaimed.

Models with per-request state (a recurrent, conv or sliding-window cache:
cache_check.per_request_state) are proven for one row per request: a pass of L requests'
decode rows gives each its solo bits (`per_request_proof`), `request_rows` = 1; their
state can be neither rewound (no speculation) nor stored (no prefix cache).
"""
import inspect
import sys
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from .. import cpu_blas, custom
from ..custom.precompile import activation_dtype
from ..proof_steps import step_done
from .cache_check import cache_invariance_problem, cache_refusal, per_request_state  # noqa: F401 (re-exported)
from .expert_rows import ExpertRowsProof, default_pass_rows, expert_blocks, prove_one_call
from .layers import EXPERT_BLOCKS, LAYER_SWAPS, Setting, install, install_plain_kernels, model_module_names, uninstall
from .ops import ROWWISE, STRATEGIES, Strategy
from .warmup import precompile_kernels
from .selftest import SelfTestResult, seconds_per_step, self_test

# Candidates "auto" tries, in order; the first proven is kept. rowwise is the fallback. A
# candidate that cannot run here (gemv_rows or skinny without CUDA / a GPU kernel API, or
# L > 64; cpu_kernel off the CPU) is skipped unproven. cpu_kernel (the OpenBLAS shim's own
# kernel, CPU only) comes first: it batches rows over one read of the weights (docs/BENCHMARKS.md,
# CPU). gemv_rows (CUDA) before the others: decode stays MLX's own
# single-row GEMV and blocks read the weights once per 8 rows, faster than skinny for one
# stream and for 16 clients of SmolLM2. At the 8B shape skinny's blocks cost less:
# `--invariant-strategy skinny` for wide deterministic batches of large models (figures for
# both:
# bench/results/history/2026-12-01-h200-gemv-rows-issue9.md).
# strided_gemv before skinny elsewhere: its single
# row is the plain call; on CUDA with 16-bit activations skinny comes before it
# (CUDA_16BIT_AUTO_CANDIDATES: at 16 rows of an 8B shape strided_gemv failed the proof).
# Metal's skinny kernel has never been measured, so Metal keeps the default order.
# mma_rows (CUDA, 16-bit) first there: gemv_rows' forms, but an 8B's dense layers (every
# 16-bit layer of at least 4 M weights: kernels/custom/mma_rows.py) run skinny's tensor-core
# kernel at every width, so wide deterministic passes do not pay a CUDA-core fma chain per
# row, while a small model's layers keep MLX's GEMV for one row.
AUTO_CANDIDATES = ("native", "cpu_kernel", "gemv_rows", "strided_gemv", "skinny", "rowwise")
CUDA_16BIT_AUTO_CANDIDATES = ("native", "cpu_kernel", "mma_rows", "gemv_rows", "skinny", "strided_gemv", "rowwise")


def auto_candidates(model) -> tuple:
    """The order "auto" tries strategies in, for this model on the default device."""
    if custom.uses_mma(activation_dtype(model)):
        return CUDA_16BIT_AUTO_CANDIDATES
    return AUTO_CANDIDATES


# The installed Setting of each model (by id) that has cpu_kernel installed: the shim's
# switch is one per process, so it serves the largest L of them and goes off only when none
# is left.
_cpu_kernel_settings: dict[int, Setting] = {}


def _cpu_kernel_limit() -> int:
    return max((setting.call_rows for setting in _cpu_kernel_settings.values()), default=0)


def _install(model, setting: Setting) -> dict:
    if setting.strategy.dense == "cpu_kernel":
        _cpu_kernel_settings[id(model)] = setting
    cpu_blas.set_kernel_limit(_cpu_kernel_limit())
    return install(model, setting)


def _uninstall(model) -> None:
    uninstall(model)
    _cpu_kernel_settings.pop(id(model), None)
    cpu_blas.set_kernel_limit(_cpu_kernel_limit())


@dataclass(frozen=True)
class InstalledInvariance:
    """What `set_batch_invariant_limit` installed on a model (`model._lockstep_invariance`):
    the mechanism and its self-test. What a deployment guarantees with it is decided above
    (server/engine/guarantee/guarantee.py)."""

    call_rows: int  # L: the most rows one kernel call may hold, each row its one-row bits; 0 = off
    strategy: str
    backend: str
    guaranteed: bool  # self-test passed and nothing in the model is left uncovered
    reason: str
    uncovered: tuple = ()  # parts of the model the canonical path does not reach
    self_test: SelfTestResult | None = None
    candidates: tuple = field(default=())  # (name, passed, seconds per L-row step or None)
    layers: dict = field(default_factory=dict)  # swapped layer counts
    # Rows of one request a guaranteed pass may hold: L, or 1 where a layer keeps per-request
    # state (its multi-row call is not its one-row calls: no speculation, no canonical chunks).
    request_rows: int = 0
    per_request_state: str | None = None  # the first such layer, described
    # MoE expert rows: one call for 1..n rows where proven, else per row (expert_rows.py)
    expert_rows: ExpertRowsProof | None = None


def uncovered_parts(model) -> tuple:
    """Parts of the model whose rows the canonical ops do not reach (the guarantee is refused)."""
    from mlx_lm.models.cache import make_prompt_cache

    found = []
    problem = cache_refusal(make_prompt_cache(model))
    if problem:
        found.append(f"KV cache: {problem}")
    modules = dict(model.named_modules())
    swapped = set(LAYER_SWAPS.values())
    for name, m in model.named_modules():
        kind = type(m).__name__
        if kind in ("SwitchLinear", "QuantizedSwitchLinear"):
            # covered inside mlx-lm's own expert blocks (run per row), not when a model calls it
            parent = modules.get(name.rpartition(".")[0])
            if not (isinstance(parent, EXPERT_BLOCKS) and (type(parent) in LAYER_SWAPS or type(parent) in swapped)):
                found.append(f"{name}: {kind} (MoE gather_mm/gather_qmm) outside mlx-lm's "
                             f"SwitchGLU/SwitchMLP is not canonicalised")
        elif isinstance(m, nn.QQLinear):
            found.append(f"{name}: QQLinear (quantized activations) is not canonicalised")
        elif isinstance(m, tuple(LAYER_SWAPS)) and type(m) not in LAYER_SWAPS and type(m) not in swapped:
            found.append(f"{name}: {kind} subclasses {type(m).__mro__[1].__name__} with its own call")
    for mod in sorted(model_module_names(model)):
        try:
            source = inspect.getsource(sys.modules[mod])
        except (OSError, TypeError):
            continue
        if "mx.fast.scaled_dot_product_attention" in source and mod != "mlx_lm.models.base":
            found.append(f"{mod}: calls mx.fast.scaled_dot_product_attention directly")
    return tuple(found)


def installed_invariance(model) -> InstalledInvariance | None:
    """The invariance installed on this model, or None."""
    return getattr(model, "_lockstep_invariance", None)


def _no_per_request_proof(model, call_rows: int, **options) -> SelfTestResult:
    return SelfTestResult(False, str(mx.default_device()), call_rows, (), (), reason="a model with per-request state is proven "
                          "in ragged passes: no per_request_proof was given")


def _resolve(strategy, model) -> tuple:
    if isinstance(strategy, Strategy):
        return (strategy,)
    if strategy == "auto":
        return tuple(STRATEGIES[n] for n in auto_candidates(model))
    if strategy in STRATEGIES:
        return (STRATEGIES[strategy],)
    raise ValueError(f"strategy {strategy!r}: use 'auto', a Strategy, or one of {sorted(STRATEGIES)}")


def _expert_setting(model, call_rows: int, candidate: Strategy, expert_form: str,
                    pass_rows: int | None, proof_cache) -> tuple[Setting, ExpertRowsProof | None]:
    """The setting of `candidate` (installed) with its MoE expert rows' form: one call for the
    widths prove_one_call showed keep every row's per-row bits under this candidate, else per
    row. The one place that form is decided. It runs with verify=False too: it picks a form (as
    the custom kernels' smoke tests do), so a re-install runs the rows as the proven one did."""
    setting = Setting(call_rows, candidate)
    if candidate.is_native or not expert_blocks(model):
        return setting, None
    if expert_form == "per_row":
        return setting, ExpertRowsProof(0, "asked for")
    widest = max(call_rows, default_pass_rows() if pass_rows is None else pass_rows)
    proof = prove_one_call(model, widest, proof_cache=proof_cache, strategy=candidate.name)
    if proof.one_call_rows:
        setting = Setting(call_rows, candidate, proof.one_call_rows)
        model._lockstep_setting = setting  # what the installed model's calls read
    return setting, proof


def set_batch_invariant_limit(model, call_rows: int, strategy="auto", *, verify: bool = True,
                              measure: bool = False, per_request_proof=None, expert_rows: str = "auto",
                              expert_pass_rows: int | None = None,
                              **self_test_options) -> InstalledInvariance:
    """Install batch invariance for M <= `call_rows` rows (0 restores native). Idempotent.

    strategy: "auto" (auto_candidates(model): expected-speed order, the first proven one; with
    measure=True every candidate is proven and timed and the fastest proven one kept; none
    proven: rowwise, unclaimed), a name in STRATEGIES, or a Strategy.
    verify=False skips the self-test (nothing is claimed; the MoE expert form's proof still runs).
    per_request_proof: the self-test of a model with per-request state, which runs ragged
    passes (kernels.batching.ragged_selftest.per_request_self_test: batching sits above this
    package, so the caller hands it in); without it such a model is installed unproven.
    expert_rows: how MoE expert blocks run a deterministic call's rows: "auto" (one unsorted
    gather call for every width the expert proof covers, kernels/invariance/expert_rows.py,
    else per row) or "per_row". expert_pass_rows: the widest pass that proof covers beyond L
    (default expert_rows.default_pass_rows()); wider passes run one call per block of that many rows.
    self_test_options go to kernels.invariance.selftest.self_test (prefixes, widths, seed).
    """
    if expert_rows not in ("auto", "per_row"):
        raise ValueError(f"expert_rows {expert_rows!r}: use 'auto' or 'per_row'")
    _uninstall(model)
    backend = str(mx.default_device())
    if call_rows <= 0:
        invariance = InstalledInvariance(0, "native", backend, False, "off (L = 0)", layers=install_plain_kernels(model))
        model._lockstep_invariance = invariance
        return invariance

    from mlx_lm.models.cache import make_prompt_cache

    uncovered = uncovered_parts(model)
    per_request = per_request_state(make_prompt_cache(model))
    # One request's block of rows (self_test), or one row of each of several requests where a
    # layer keeps per-request state (a block of such a layer is not its one-row calls).
    prove = self_test if per_request is None else per_request_proof or _no_per_request_proof
    candidates = _resolve(strategy, model)
    tried = []  # (strategy, self-test result or None, seconds per step or None)
    skipped = {}  # strategy name -> why it cannot run here (never installed, never proven)
    for candidate in candidates:
        missing = candidate.unavailable_reason(call_rows)
        if missing:
            skipped[candidate.name] = missing
            continue
        _install(model, Setting(call_rows, candidate))
        precompile_kernels(model, call_rows)  # every width's instances at once, before the proof launches them
        setting, experts = _expert_setting(model, call_rows, candidate, expert_rows, expert_pass_rows,
                                           self_test_options.get("proof_cache"))
        result = prove(model, call_rows, **self_test_options) if verify else None
        # Timed only when asked to choose by measurement: an L-row step plus a decode step.
        seconds = (seconds_per_step(model, call_rows) + seconds_per_step(model, 1)
                   if result and measure else None)
        tried.append((candidate, result, seconds, setting, experts))
        _uninstall(model)
        step_done()
        if result and not measure:
            break  # candidates come fastest first: the first proven one is the pick

    passing = [t for t in tried if t[1]]
    if passing:
        chosen, result, _, setting, experts = min(passing, key=lambda t: t[2] or 0.0)
        why = f"self-test passed on {backend}"
        if len(candidates) > 1:
            failed = [t[0].name for t in tried if not t[1]]
            why += (f"; measured fastest of {[t[0].name for t in passing]}" if measure
                    else f"; first proven in speed order" + (f" (failed: {failed})" if failed else ""))
    else:
        chosen = ROWWISE if strategy == "auto" else candidates[0]
        result, setting, experts = next((t[1:2] + t[3:] for t in tried if t[0] == chosen),
                                        (None, Setting(call_rows, chosen), None))
        why = (f"{chosen.name} cannot run on {backend} ({skipped[chosen.name]}); its layers run"
               " today's forms, unproven" if chosen.name in skipped
               else "not verified (verify=False)" if result is None
               else f"self-test failed on {backend}: {result.reason}")

    layers = _install(model, setting)
    guaranteed = bool(result) and not uncovered
    if skipped and chosen.name not in skipped:
        why += "; skipped: " + ", ".join(f"{name} ({reason})" for name, reason in skipped.items())
    if experts is not None:
        why += "; " + experts.describe()
    if uncovered:
        why += f"; not guaranteed: {len(uncovered)} uncovered part(s), first: {uncovered[0]}"
    elif per_request is not None:
        why += f"; one row per request ({per_request} runs per request)"
    invariance = InstalledInvariance(call_rows, chosen.name, backend, guaranteed, why, uncovered, result,
                                     tuple((t[0].name, None if t[1] is None else bool(t[1]), t[2]) for t in tried),
                                     layers, call_rows if per_request is None else 1, per_request, experts)
    model._lockstep_invariance = invariance
    return invariance
