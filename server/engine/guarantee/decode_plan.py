"""How a request is decoded: the deployment's settings plus the request's own choices.

`plan_request` turns (deployment, request) into a `DecodePlan` or rejects the request with
the offending parameter named. Deterministic requests get speculation only where the
deployment's batch-invariant limit L is proven (verification runs k + 1 <= L rows), so
their tokens never depend on the method, k, or what else the server is doing.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from lockstep.server.engine.guarantee.deployment import Deployment

METHODS = ("none", "draft", "prompt_lookup")
# Drafts from the client's predicted answer (OpenAI's Predicted Outputs): the method of every
# request that carries a prediction, never one a request names.
PREDICTION = "prediction"


class RequestRejected(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class Determinism(StrEnum):
    """How a request's determinism is kept, decided by `plan_request` and read by the engine
    only from the plan."""

    NONE = "none"  # it asked for none: native forms, any pass
    # canonical forms; its rows may share passes of at most the guarantee's `pass_rows` rows
    # with other requests' rows
    SHARED = "shared"
    # its rows and prompt chunks run in passes of their own: the guarantee is unproven, or
    # proven for one request's rows only
    ALONE = "alone"


DETERMINISM = tuple(Determinism)


@dataclass(frozen=True)
class DecodePlan:
    determinism: Determinism
    method: str  # "none" | "draft" | "prompt_lookup" | "prediction"
    num_draft_tokens: int  # k (0 when method is "none")
    guaranteed: bool = False  # the deployment's proof covers this request's tokens
    note: str = ""
    adaptive: bool = False  # k chosen per step up to num_draft_tokens (deployment setting)
    seed: int | None = None  # a sampled deterministic request's seed (given, or drawn by the server)

    @property
    def deterministic(self) -> bool:
        return self.determinism != Determinism.NONE


PLAIN = DecodePlan(Determinism.NONE, "none", 0)


def plan_request(deployment: Deployment, *, deterministic: bool, speculative: str | None,
                 num_draft_tokens: int | None, prediction: bool = False) -> DecodePlan:
    """The one place a request's `deterministic` flag is read: everything after goes by the plan.

    With a `prediction` the drafts are the prediction's tokens (`speculative` "none" turns
    them off); k is `num_draft_tokens`, else the server's largest (a prediction's drafts are
    the client's own guess of the answer), clipped like any k for deterministic requests."""
    method = speculative or deployment.speculative
    if prediction and speculative not in (None, "none"):
        raise RequestRejected("speculative", f"a request with a prediction drafts from the prediction; leave "
                                             f"speculative out (or \"none\": no drafts), got {speculative!r}")
    if prediction and speculative is None:
        method = PREDICTION
    elif method not in METHODS:
        raise RequestRejected("speculative", f"speculative must be one of {list(METHODS)}")
    note = ""
    if method != "none" and not deployment.speculation:
        if speculative not in (None, "none"):
            why = deployment.speculation_refusal or "this model's state cannot be rewound past rejected drafts"
            if not deterministic:
                raise RequestRejected("speculative", f"{why}: this server decodes it without speculation")
            # A deterministic answer is the same with or without drafts: it is served without.
            note = f"decoded without drafts ({speculative} asked for): {why}"
        method = "none"  # the deployment's default does not apply to this model
    if method == "draft" and deployment.draft_refusal:
        # Drafts change the speed, never an answer: where they would only slow it, none.
        method, note = "none", f"decoded without drafts: {deployment.draft_refusal}"
    elif method == "draft" and deployment.draft_model is None:
        if not deployment.draft_loading:
            why = (f"its draft model could not be loaded: {deployment.draft_problem}" if deployment.draft_problem
                   else "start it with --draft-model")
            raise RequestRejected("speculative", f"this server has no draft model ({why})")
        # Drafts change the speed, never a deterministic answer; until the draft model is
        # loaded (after serving started) such requests decode without them.
        method, note = "none", "the draft model is still being loaded: decoded without drafts"
    if num_draft_tokens is not None and num_draft_tokens > deployment.max_draft_tokens:
        raise RequestRejected(
            "num_draft_tokens",
            f"num_draft_tokens is at most {deployment.max_draft_tokens} on this server "
            f"(got {num_draft_tokens}; the server's --max-draft-tokens)")
    default_k = deployment.max_draft_tokens if method == PREDICTION else deployment.num_draft_tokens
    k = min(num_draft_tokens or default_k, deployment.max_draft_tokens)
    if method == "none":
        k = 0

    adaptive = deployment.adaptive_draft_tokens and method != "none"
    if not deterministic:
        return DecodePlan(Determinism.NONE, method, k, adaptive=adaptive, note=note)

    guarantee = deployment.guarantee
    if not guarantee.guaranteed:
        why = ("the batch-invariant limit is 0" if guarantee.call_rows == 0
               else "batch invariance was not proven on this backend")
        return DecodePlan(Determinism.ALONE, "none", 0,
                          note=f"{why}: ran without speculation, in passes of its own")
    widest = guarantee.call_rows - 1  # verification evaluates k + 1 rows in one pass
    if method != "none" and k > widest:
        if num_draft_tokens is not None:
            raise RequestRejected(
                "num_draft_tokens",
                f"deterministic requests allow at most {widest} draft tokens "
                f"(batch-invariant limit {guarantee.call_rows})")
        k = widest  # the deployment's default is clipped, not refused
    if k < 1:
        method, k, adaptive = "none", 0, False
    determinism = Determinism.SHARED if guarantee.shared_passes else Determinism.ALONE
    return DecodePlan(determinism, method, k, guaranteed=True, adaptive=adaptive, note=note)
