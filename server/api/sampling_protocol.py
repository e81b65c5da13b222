"""What the OpenAI-shaped requests share: the base `Request` (unknown fields a 400, strict types,
no lone surrogates), the limits OpenAI sets (stop strings, choices, logit_bias, seed,
metadata) and `SamplingRequest`, the fields /v1/chat/completions and /v1/completions share.

Requests carry the whole current chat-completions and completions schema (docs/API.md has
the table of every field and what lockstep does with it). Each field is implemented,
accepted with its documented effect (bookkeeping such as `store` and `metadata` is
ignored), or refused with a 400 naming it and saying why (`modalities: ["audio"]`: lockstep
writes text only). Unknown fields are still a 400 naming the field, as OpenAI's are, and
types are strict as OpenAI's are (`"4"`, `true` or `1e3` is not an integer, `"yes"` is not a
boolean); `null` is the default wherever the spec makes a field nullable. Rules that a
union type would report obscurely (how many stop strings, one prompt, text-only content)
are checked first and named plainly, and a lone surrogate is refused in any field.
"""
from __future__ import annotations

import json
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16  # n: choices per request (each is generated as a request of its own)
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
# OpenAI's seed is a signed 64-bit integer; outside it a seed would alias another one.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# OpenAI's metadata: at most 16 pairs, keys of at most 64 characters, values of at most 512.
MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


# OpenAI's logit_bias keys are "token IDs as strings": ASCII digits only (str.isdigit() also
# takes "²" and "٣"), and at most 10 of them, so int() never meets a 5000-digit key.
TOKEN_ID = re.compile(r"[0-9]{1,10}")


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_unicode(value, field: str):
    """Refuses a lone surrogate (a valid JSON escape, invalid Unicode) anywhere in `value`.

    It could not be tokenized, and echoed into a JSON answer or an error it cannot be
    encoded; so every field of a request is checked, keys included (iteratively: the
    body may be nested as deep as the JSON parser allows).
    """
    stack = [(value, field)]
    while stack:
        part, where = stack.pop()
        if isinstance(part, str):
            if not _is_unicode(part):
                raise ValueError(f"text must be valid Unicode (a lone surrogate in {where})")
        elif isinstance(part, dict):
            for key, item in part.items():
                if isinstance(key, str) and not _is_unicode(key):
                    raise ValueError(f"text must be valid Unicode (a lone surrogate in a key of {where})")
                if isinstance(item, (str, dict, list)):
                    stack.append((item, f"{where}.{key}"))
        elif isinstance(part, list):
            stack.extend((item, f"{where}.{i}") for i, item in enumerate(part)
                         if isinstance(item, (str, dict, list)))
    return value


def unicode_checked():
    """A before-validator for every field of a top-level request, so errors name the field."""
    def check(cls, value, info: ValidationInfo):
        return _check_unicode(value, info.field_name)

    return field_validator("*", mode="before")(classmethod(check))


def shown(value, limit: int = 40) -> str:
    """A user's value in an error message: as JSON (escaped, not a Python repr), cut short."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _omit_if_none(value) -> bool:
    return value is None


def _refused(field: str, why: str, allowed=(None,)):
    """A validator for a field lockstep cannot honour: accepted only with a value in `allowed`."""
    def check(cls, value):
        if value not in allowed:
            raise ValueError(f"{field} is not supported: {why}")
        return value

    return field_validator(field)(classmethod(check))


def _nulls_are_defaults(fields: tuple[str, ...]):
    """A before-validator: the spec makes these fields nullable, and null means the default."""
    def drop(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in fields)}
        return data

    return model_validator(mode="before")(classmethod(drop))


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Request):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None

    # Obfuscation pads stream events against a length side channel; lockstep sends none, and
    # a client that asks for it is told so rather than left without it unknowingly.
    _no_obfuscation = _refused("include_obfuscation", "lockstep does not pad stream events",
                               allowed=(None, False))


Metadata = Annotated[dict[Annotated[str, Field(max_length=MAX_METADATA_KEY)],
                          Annotated[str, Field(max_length=MAX_METADATA_VALUE)]],
                     Field(max_length=MAX_METADATA)]


class SamplingRequest(Request):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # 0 = off (OpenAI has no top_k; vLLM-style)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    user: str | None = None  # bookkeeping: ignored
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # Token id (as a string, as JSON keys are) -> bias in [-100, 100].
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    # lockstep extensions, carried to the engine unchanged.
    deterministic: bool = False
    speculative: Literal["none", "draft", "prompt_lookup"] | None = None
    num_draft_tokens: int | None = Field(default=None, ge=1)
    # each choice's `lockstep` object lists the answer's token ids (`lockstep replay` asks for them)
    return_token_ids: bool = False

    _defaults_for_nulls = _nulls_are_defaults((
        "temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty", "logprobs", "echo"))
    _valid_unicode = unicode_checked()

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_and_range(cls, bias):
        for key, value in (bias or {}).items():
            if not TOKEN_ID.fullmatch(key):
                raise ValueError(f"logit_bias keys must be token ids (decimal integers as strings), "
                                 f"got {shown(key)}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {key}")
        return bias

    @field_validator("stop", mode="before")
    @classmethod
    def _at_most_four_stops(cls, stop):
        if isinstance(stop, list) and len(stop) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stop)}")
        return stop

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stop

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def bias_items(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), v) for k, v in (self.logit_bias or {}).items())

    def prediction_text(self) -> str | None:
        """The client's draft of the answer (Predicted Outputs), or None."""
        return None
