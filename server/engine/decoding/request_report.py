"""What a request reports back: its plan's determinism and speculation, the deployment's L,
and once it has run, its draft counts and receipt.

`RequestReport` is typed data the API reads by attribute (usage, metrics, records);
`render()` is the one place the response's `lockstep` object is built from it, with the keys
in the order clients have always seen them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from lockstep.server.engine.guarantee.decode_plan import PREDICTION, DecodePlan


@dataclass(frozen=True)
class RequestReport:
    deterministic: bool = False
    batch_invariant_limit: int = 0  # the deployment's L (rows one kernel call may hold, proven)
    guaranteed: bool = False  # the deployment's proof covers this request's tokens
    speculative: str = "none"  # the method it decoded with
    num_draft_tokens: int = 0  # k
    seed: int | None = None  # a sampled deterministic request's seed
    adaptive_draft_tokens: bool = False
    note: str = ""
    # None until the request has run (a plan's report has no counts)
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None
    forward_passes: int | None = None
    receipt: dict | None = None  # receipt.Receipt.as_dict()

    @classmethod
    def planned(cls, plan: DecodePlan, deployment) -> "RequestReport":
        """What a request planned with `plan` on `deployment` reports before it runs."""
        return cls(deterministic=plan.deterministic, batch_invariant_limit=deployment.guarantee.call_rows,
                   guaranteed=plan.guaranteed, speculative=plan.method, num_draft_tokens=plan.num_draft_tokens,
                   seed=plan.seed, adaptive_draft_tokens=plan.adaptive, note=plan.note)

    def finished(self, *, drafted: int, accepted: int, passes: int, receipt: dict | None) -> "RequestReport":
        """This report with what the request's decoding counted and its receipt."""
        return replace(self, drafted_tokens=drafted, accepted_tokens=accepted, forward_passes=passes,
                       receipt=receipt)

    @property
    def prediction_tokens(self) -> tuple[int, int]:
        """(accepted, rejected) prediction tokens: its drafts, when they came from the request's
        prediction, that verification accepted and rejected (docs/API.md)."""
        if self.speculative != PREDICTION:
            return 0, 0
        accepted = self.accepted_tokens or 0
        return accepted, (self.drafted_tokens or 0) - accepted

    def render(self) -> dict:
        """The response's `lockstep` object."""
        info = {
            "deterministic": self.deterministic,
            "batch_invariant_limit": self.batch_invariant_limit,
            "guaranteed": self.guaranteed,
            "speculative": self.speculative,
            "num_draft_tokens": self.num_draft_tokens,
        }
        if self.seed is not None:
            info["seed"] = self.seed
        if self.adaptive_draft_tokens:
            info["adaptive_draft_tokens"] = True
        if self.note:
            info["note"] = self.note
        if self.drafted_tokens is not None:
            info.update(drafted_tokens=self.drafted_tokens, accepted_tokens=self.accepted_tokens,
                        forward_passes=self.forward_passes, receipt=self.receipt)
        return info


def rendered(report: RequestReport | None) -> dict | None:
    """`report.render()`, or None where there is no report (a plain generation without a plan)."""
    return report.render() if report is not None else None
