"""A deterministic answer's receipt: what reproduces it and what to compare (docs/API.md, Receipts).

`Receipt` is fed each chosen token as the request generates and gives, on the final Delta, a
small dict: the deployment that answered (model content digest, `system_fingerprint`, L and
whether the guarantee covered the answer), every request field that shapes tokens (the seed,
sampling, penalties, a digest of logit_bias, stops, max_tokens, a digest of the output grammar),
and sha256 digests of the prompt's token ids, of the answer's token ids and, when the request
asked for logprobs, of the chosen tokens' logprob bits. No token lists: a receipt stays the same
size whatever the answer's length, and costs one hash update per token.
"""
from __future__ import annotations

import hashlib
import struct
from functools import lru_cache
from importlib import metadata

PREFIX = "sha256:"


def _digest(data: bytes) -> str:
    return PREFIX + hashlib.sha256(data).hexdigest()


def token_digest(tokens) -> str:
    """The digest of a token id sequence (little-endian uint32s), as receipts give it."""
    return _digest(struct.pack(f"<{len(tokens)}I", *tokens))


@lru_cache(maxsize=1)
def lockstep_version() -> str:
    try:
        return metadata.version("lockstep")
    except metadata.PackageNotFoundError:
        return "unknown"


def _sampling(request) -> dict:
    s = request.sampling
    bias = request.logit_bias
    grammar = getattr(request.grammar, "source", None)
    return {
        "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p,
        "presence_penalty": request.presence_penalty, "frequency_penalty": request.frequency_penalty,
        "logit_bias": _digest(repr(sorted(bias)).encode()) if bias else None,
        "stop": list(request.stop), "max_tokens": request.max_tokens,
        "grammar": _digest(grammar.encode()) if grammar is not None else None,
    }


class Receipt:
    """One request's receipt, built as its tokens are chosen."""

    def __init__(self, request, prompt: list[int], plan, deployment):
        self._fixed = {
            "version": lockstep_version(),
            "model": getattr(deployment, "model_digest", "") or None,
            "system_fingerprint": getattr(deployment, "fingerprint", "") or None,
            "batch_invariant_limit": deployment.guarantee.call_rows if deployment is not None else 0,
            "deterministic": plan.deterministic,
            "guaranteed": plan.guaranteed,
            "seed": None if request.sampling.greedy else request.sampling.seed,
            "sampling": _sampling(request),
            "prompt": token_digest(prompt),
        }
        self._answer = hashlib.sha256()
        self._logprobs = hashlib.sha256() if request.sampling.top_logprobs is not None else None
        self._count = 0

    def add(self, token: int, logprob: float | None) -> None:
        self._answer.update(struct.pack("<I", token))
        if self._logprobs is not None and logprob is not None:
            self._logprobs.update(struct.pack("<d", logprob))  # a float32's value, exactly
        self._count += 1

    def as_dict(self) -> dict:
        return {**self._fixed, "answer": PREFIX + self._answer.hexdigest(), "answer_tokens": self._count,
                "logprobs": PREFIX + self._logprobs.hexdigest() if self._logprobs is not None else None}
