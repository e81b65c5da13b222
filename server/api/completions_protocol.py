"""/v1/completions' request: `CompletionRequest` (a prompt as text or token ids, echo, suffix,
best_of)."""
from __future__ import annotations

from typing import Annotated

from pydantic import Field, ValidationInfo, field_validator

from lockstep.server.api.sampling_protocol import MAX_CHOICES, MAX_TOP_LOGPROBS, SamplingRequest


TokenIds = Annotated[list[int], Field(min_length=1)]


class CompletionRequest(SamplingRequest):
    # A string, one string in a list, token ids, or one list of token ids.
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1, max_length=1)
    ]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt):
        # A list of strings or of token lists is a batch of prompts; lockstep takes one.
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(x, (str, list)) for x in prompt):
            raise ValueError(f"one prompt per request is supported, got {len(prompt)}")
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix):
        if suffix:
            raise ValueError("suffix is not supported")
        return suffix

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of, info: ValidationInfo):
        # best_of > n ranks candidates by log probability server-side and returns the best n;
        # lockstep returns every choice it generates, so only best_of == n (the default) is met.
        n = info.data.get("n", 1)
        if best_of is not None and best_of != n:
            raise ValueError(f"best_of is supported only equal to n ({n}): lockstep returns every choice "
                             "it generates")
        return best_of

    def token_limit(self) -> int | None:
        return self.max_tokens

    def logprobs_count(self) -> int | None:
        return self.logprobs
