"""How a request is decoded: the deployment's settings plus the request's own choices.

`plan_request` turns (deployment, request) into a `DecodePlan` or rejects the request with
the offending parameter named. Deterministic requests get speculation only where the
deployment's batch-invariant limit L is proven (verification runs k + 1 <= L rows), so
their tokens never depend on the method, k, or what else the server is doing.
"""
from __future__ import annotations

from dataclasses import dataclass

METHODS = ("none", "draft", "prompt_lookup")
# Drafts proposed in one engine step (a draft model runs k passes in it), so k bounds how
# long one request can hold the engine: a server maximum, `--max-draft-tokens`.
MAX_DRAFT_TOKENS = 16


class RequestRejected(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Deployment:
    """Per-deployment decoding settings (from `lockstep serve` flags)."""

    limit: int = 0  # batch-invariant limit L; 0 = off
    guaranteed: bool = False  # L > 0 and the startup self-test proved it on this model
    strategy: str = "native"  # canonical kernel strategy in use
    speculative: str = "none"  # default method for requests that do not choose
    num_draft_tokens: int = 4  # default k
    max_draft_tokens: int = MAX_DRAFT_TOKENS  # the largest k any request may use
    draft_model: object | None = None
    draft_name: str | None = None
    # Adaptive speculation: k chosen per step from the request's own acceptance, up to the
    # plan's k (server/engine/speculative.py AdaptiveDraftLength). pass_costs[w - 1] is the
    # measured cost of a target pass of w rows (measure_pass_costs); None: linear in w.
    adaptive_draft_tokens: bool = False
    pass_costs: tuple[float, ...] | None = None
    prefill_chunk: int = 512
    # Requests' KV in one shared pool, one attention launch per layer for a whole pass
    # (kernels/batching/kv_pool.py): "kernel" (the GPU kernel), "reference" (one MLX attention call per
    # row, where there is no kernel) or "off" (each request its own KVCache).
    kv_pool: str = "off"
    # kernels.batching.ragged_selftest.RaggedProof for L (None: not proven here; the engine proves it)
    ragged_proof: object | None = None
    fingerprint: str = ""


@dataclass(frozen=True)
class DecodePlan:
    deterministic: bool
    method: str  # "none" | "draft" | "prompt_lookup"
    num_draft_tokens: int  # k (0 when method is "none")
    exclusive: bool  # run with no other request interleaved
    note: str = ""
    adaptive: bool = False  # k chosen per step up to num_draft_tokens (deployment setting)

    def extension(self, deployment: Deployment) -> dict:
        """The `lockstep` object returned with the response (counts are added by generate)."""
        info = {
            "deterministic": self.deterministic,
            "batch_invariant_limit": deployment.limit,
            "guaranteed": deployment.guaranteed if self.deterministic else False,
            "speculative": self.method,
            "num_draft_tokens": self.num_draft_tokens,
        }
        if self.adaptive:
            info["adaptive_draft_tokens"] = True
        if self.note:
            info["note"] = self.note
        return info


def plan_request(deployment: Deployment, *, deterministic: bool, speculative: str | None,
                 num_draft_tokens: int | None) -> DecodePlan:
    method = speculative or deployment.speculative
    if method not in METHODS:
        raise RequestRejected("speculative", f"speculative must be one of {list(METHODS)}")
    if method == "draft" and deployment.draft_model is None:
        raise RequestRejected("speculative", "this server has no draft model (start it with --draft-model)")
    if num_draft_tokens is not None and num_draft_tokens > deployment.max_draft_tokens:
        raise RequestRejected(
            "num_draft_tokens",
            f"num_draft_tokens is at most {deployment.max_draft_tokens} on this server "
            f"(got {num_draft_tokens}; the server's --max-draft-tokens)")
    k = min(num_draft_tokens or deployment.num_draft_tokens, deployment.max_draft_tokens)
    if method == "none":
        k = 0

    adaptive = deployment.adaptive_draft_tokens and method != "none"
    if not deterministic:
        return DecodePlan(False, method, k, exclusive=False, adaptive=adaptive)

    if not deployment.guaranteed:
        why = ("the batch-invariant limit is 0" if deployment.limit == 0
               else "batch invariance was not proven on this backend")
        return DecodePlan(True, "none", 0, exclusive=True,
                          note=f"{why}: ran without speculation and alone")
    widest = deployment.limit - 1  # verification evaluates k + 1 rows in one pass
    if method != "none" and k > widest:
        if num_draft_tokens is not None:
            raise RequestRejected(
                "num_draft_tokens",
                f"deterministic requests allow at most {widest} draft tokens "
                f"(batch-invariant limit {deployment.limit})")
        k = widest  # the deployment's default is clipped, not refused
    if k < 1:
        method, k, adaptive = "none", 0, False
    return DecodePlan(True, method, k, exclusive=False, adaptive=adaptive)
