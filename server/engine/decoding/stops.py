"""Incremental detokenization with stop sequences and streaming hold-back.

Text is decoded with the tokenizer in a small sliding window that starts inside the prompt
(as vLLM does). mlx-lm's streaming detokenizers drop the leading space of the first
generated token, which is wrong for a completion ("The sky is" -> " blue"); decoding with
prompt context keeps it, and holds back incomplete UTF-8 sequences until they complete.

Text is released only when it cannot be the start of a stop string: the longest tail of
the pending text that is a prefix of some stop string is held back until the next token
settles it. So a stop string split across tokens is still caught, no text past a stop is
ever released, and the stop string itself is never part of the output.

Each token's position in the text is tracked, so its logprobs are released together with
(or after) its text, and tokens that only produced the stop string are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Release:
    """What may be sent now: new text and the items (e.g. logprobs) of its tokens."""

    text: str = ""
    items: list[Any] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # where each item's text starts
    stopped: bool = False  # a stop string was found; generation must end

    def merged(self, later: "Release") -> "Release":
        """This release followed by `later` (offsets are absolute, so they just concatenate)."""
        return Release(self.text + later.text, self.items + later.items,
                       self.offsets + later.offsets, later.stopped)


def _held_back_length(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


def direct_decode(tokenizer, probe: list[int]):
    """`tokenizer.decode`, or the `tokenizers` backend's own decode where it gives the same
    text: no clean-up of tokenization spaces, and the same result on `probe`. Every generated
    token costs two decodes, and transformers' wrapping costs several times the call it wraps."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper holds transformers'
    backend = getattr(hf, "_tokenizer", None)  # ... which holds the `tokenizers` one
    if (backend is None or not callable(getattr(backend, "decode", None))
            or getattr(hf, "clean_up_tokenization_spaces", True)):
        return tokenizer.decode

    def decode(ids: list[int]) -> str:
        return backend.decode(ids, skip_special_tokens=False)

    try:
        same = decode(probe) == tokenizer.decode(probe)
    except Exception:  # a backend that takes other arguments: keep the wrapper
        return tokenizer.decode
    return decode if same else tokenizer.decode


class IncrementalDecoder:
    """Text of generated tokens, one token at a time, decoded with prompt context.

    The window's text up to `_read` is kept from the decode that read it, so a token costs one
    decode; the window moves on (one decode more) once it holds `WINDOW` tokens, keeping the
    last `PROMPT_CONTEXT` as context."""

    PROMPT_CONTEXT = 4  # tokens kept at the window's start so spaces decode as in context
    WINDOW = 8  # the window's most tokens before it moves on (a decode costs by its length too)
    PROBE = 64  # prompt tokens the direct decode is checked on

    def __init__(self, tokenizer, prompt_tokens: list[int]):
        self._decode = direct_decode(tokenizer, list(prompt_tokens[-self.PROBE :]))
        self._tokens = list(prompt_tokens[-self.PROMPT_CONTEXT :])
        self._start = 0  # window start: text before `_read` was already returned
        self._read = len(self._tokens)
        self._read_text = self._decode(self._tokens)  # the window's text up to `_read`

    def _new_text(self) -> tuple[str, str]:
        """The window's whole text and the part of it past `_read`."""
        text = self._decode(self._tokens[self._start :])
        return text, text[len(self._read_text) :]

    def add(self, token: int) -> str:
        self._tokens.append(token)
        whole, text = self._new_text()
        if not text or text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait
            return ""
        self._read, self._read_text = len(self._tokens), whole
        if self._read - self._start >= self.WINDOW:
            self._start = self._read - self.PROMPT_CONTEXT
            self._read_text = self._decode(self._tokens[self._start : self._read])
        return text

    def finish(self) -> str:
        """Whatever is still held back (incomplete characters become U+FFFD)."""
        _, text = self._new_text()
        self._start = self._read = len(self._tokens)
        self._read_text = ""
        return text


class StopTextStream:
    """Feed tokens one at a time; get back the text (and token items) safe to send."""

    def __init__(self, decoder: IncrementalDecoder, stops: list[str]):
        self._decoder = decoder
        self._stops = [s for s in stops if s]
        self._released = 0  # characters of the full text already released
        self._text = ""  # full text decoded so far
        self._pending_items: list[tuple[int, Any]] = []  # (text offset, item)
        self.stopped = False
        self.matched: str | None = None  # the stop string found, once one is

    @property
    def text(self) -> str:
        """Everything released so far."""
        return self._text[: self._released]

    def add(self, token: int, item: Any = None) -> Release:
        """Add one generated token; `item` travels with its text (e.g. its logprobs)."""
        self._pending_items.append((len(self._text), item))
        self._text += self._decoder.add(token)
        return self._release(final=False)

    def finish(self) -> Release:
        """Generation ended for another reason: flush everything still held back."""
        self._text += self._decoder.finish()
        return self._release(final=True)

    def _release(self, final: bool) -> Release:
        if self.stopped:
            return Release(stopped=True)
        stop_at = self._find_stop()
        if stop_at is not None:
            self.stopped = True
            end = stop_at
        elif final:
            end = len(self._text)
        else:
            end = len(self._text) - _held_back_length(self._text[self._released :], self._stops)
        release = Release(text=self._text[self._released : end], stopped=self.stopped)
        self._released = end
        # An item is released once text after its start is released (a token whose text is
        # still held back waits); at the end, items that only made up the stop are dropped.
        keep = []
        for offset, item in self._pending_items:
            if offset < end or (final and stop_at is None):
                release.items.append(item)
                release.offsets.append(offset)
            elif not self.stopped:
                keep.append((offset, item))
        self._pending_items = keep
        return release

    def _find_stop(self) -> int | None:
        # A stop string can only start in unreleased text, since any prefix of one is held.
        pending = self._text[self._released :]
        hits = [(at, stop) for stop in self._stops if (at := pending.find(stop)) >= 0]
        if not hits:
            return None
        at, self.matched = min(hits, key=lambda hit: hit[0])
        return self._released + at
