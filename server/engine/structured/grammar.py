"""Grammars for constrained decoding: JSON objects, JSON schemas and tool calls → token masks.

Engine: llguidance (a maintained Rust engine; Earley parser over a lazily built token trie),
chosen by measurement (bench/grammar_engines.py, bench/results/grammar_engines.txt) over xgrammar and
outlines-core on SmolLM2's tokenizer: it honours all 14 structured-output schemas of the bench
and refuses unsupported keywords with a named error (xgrammar silently ignores them, so its
output can fail the caller's schema; outlines-core ignores integer bounds); it compiles a
schema in 0.5-5 ms (xgrammar up to ~45 ms, outlines-core up to 6 s); its mask costs ~0.03 ms a
token, 0.02% of a CPU decode step (no engine's mask is a cost that matters); and it needs no
torch (xgrammar imports it).
Its per-step work is bounded by "fuel" counts, not time, so a mask depends only on the tokens
consumed.

    compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)   # once per model
    matcher = compiler.json_schema(schema).matcher()                    # once per request
    logits = apply_mask(logits, matcher.allowed()); ...; matcher.consume(token)

JSON is generated in one fixed layout: ", " and ": " separators and no other whitespace. Free
whitespace would let a small model emit newlines or spaces forever inside a valid document.
Unknown or unsupported schema keywords are errors (llguidance's non-lenient mode), never
silently dropped: a keyword we cannot enforce becomes a GrammarError, i.e. an HTTP 400.
Strings are written without `\\u` escapes, so each string has one spelling: an extra key
cannot alias a declared one (`"\\u0078"` for `"x"`) and overwrite it once parsed.

Untrusted grammars: a schema first passes the static limits (grammar_limits.py), then the
grammar checker compiles its source in a child process (grammar_sandbox.py), and only then is
it compiled here, on a thread with a larger stack than the checker's. A limit the engine still
hits during generation is a `GrammarStopped`: the engine ends that request with a 400 naming
the request field (`response_format` / `tools`).
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from copy import copy
from typing import Iterable

import llguidance
import mlx.core as mx
import numpy as np

from lockstep.server.engine.structured import grammar_limits, grammar_sandbox
from lockstep.server.engine.scheduling.errors import RequestInvalid

# Applied over a schema's own "x-guidance" options, so a request cannot loosen them. No "u"
# among the escapes: one spelling per string (module docstring).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False,
                "json_allowed_escapes": 'nrbtf\\"'}
CACHE_SIZE = 128  # compiled grammars kept per model
ERROR_CHARS = 300  # engine messages can embed the whole grammar; keep the first line, bounded
# The request field each kind of grammar comes from (named by errors during generation).
FIELDS = {"json_schema": "response_format", "tool_calls": "tools"}
LIMIT_CODE = "grammar_limit_exceeded"
# How a tool call is written (GrammarCompiler.tool_calls): open + call (separator call)* + close,
# each call start + name_prefix + NAME + arguments_prefix + ARGUMENTS + arguments_suffix + end;
# the name as a JSON string when name_json; separator None: up to 4 whitespace characters, or none.
CALL_LAYOUT = {"open": "", "close": "", "separator": None, "name_prefix": '{"name": ', "name_json": True,
               "arguments_prefix": ', "arguments": ', "arguments_suffix": "}"}


class GrammarError(ValueError):
    """A schema/grammar the engine cannot honour; the message names the unsupported feature."""

    code: str | None = None  # the API error's code


class GrammarLimitError(GrammarError):
    """A grammar past one of the grammar engine's limits (a static limit, the checker's stack,
    memory or time, or the engine's parser/lexer limits); the message names the limit."""

    code = LIMIT_CODE


class GrammarStopped(GrammarLimitError, RequestInvalid):
    """During generation: the engine stopped the request's grammar (one of its limits, or a part
    of the schema that admits no value). Being a GenerationError, it ends just that request, as
    a 400 naming the request field."""

    def __init__(self, message: str, field: str | None, code: str | None = LIMIT_CODE):
        RequestInvalid.__init__(self, message, param=field, code=code)


def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(verbose_errors=False)  # no parser state dumps in messages


def _first_line(message: str) -> str:
    return grammar_sandbox.first_line(message)[:ERROR_CHARS] if message.strip() else "invalid grammar"


class Matcher:
    """Per-request grammar state; used from one thread."""

    def __init__(self, engine_matcher: llguidance.LLMatcher, vocab_size: int, eos_ids: frozenset[int],
                 field: str | None = None):
        self._matcher = engine_matcher
        self._vocab_size = vocab_size
        self._eos_ids = eos_ids
        self._field = field
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)  # the engine writes one bit a token

    def allowed(self) -> mx.array:
        """Bool mask (vocab_size,): the tokens allowed next.

        The engine allows every eos id once the grammar can end, and only them once it must.
        """
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self._matcher.is_error():  # e.g. a parser resource limit hit mid-document
            raise self._stopped()
        mask = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self._vocab_size].astype(bool)
        return mx.array(mask)

    def consume(self, token: int) -> None:
        token = int(token)
        if token in self._eos_ids:  # try_consume_tokens never takes eos; ending is allowed once accepting
            if not self._matcher.is_accepting() or not self._matcher.consume_token(token):
                raise self._stopped() if self._matcher.is_error() else \
                    GrammarError(f"end of sequence (token {token}) before the grammar is complete")
        # try_consume leaves the state untouched on a refused token (consume_token would
        # put the matcher in a permanent error state) unless the engine itself failed on it.
        elif self._matcher.try_consume_tokens([token]) != 1:
            if self._matcher.is_error():  # a limit hit taking an allowed token: not the token's fault
                raise self._stopped()
            raise GrammarError(f"token {token} is not allowed by the grammar here")

    def _stopped(self) -> GrammarStopped:
        where = f"{self._field}: " if self._field else ""
        error = _first_line(self._matcher.get_error())
        if error in ("NoExtension", "NoExtensionBias"):  # a dead end, not a limit
            return GrammarStopped(f"{where}the output grammar admits no way to go on during generation ({error}): "
                                  "part of the schema admits no value", self._field, code=None)
        return GrammarStopped(f"{where}the output grammar hit a grammar engine limit during generation "
                              f"({error}); simplify the schema", self._field)

    @property
    def finished(self) -> bool:
        """The grammar is complete and nothing but end-of-sequence may follow."""
        return self._matcher.is_stopped() and not self._matcher.is_error()


class Grammar:
    """A compiled grammar; `matcher()` gives fresh per-request state (cheap: a copy)."""

    def __init__(self, template: llguidance.LLMatcher, vocab_size: int, eos_ids: frozenset[int], source: str,
                 field: str | None = None):
        self._template = template  # never advanced; only copied
        self._vocab_size = vocab_size
        self._eos_ids = eos_ids
        self.source = source  # the engine's grammar text: what a pickled Grammar carries
        self.field = field  # the request field it constrains the output for (FIELDS)
        self._lock = threading.Lock()  # copies may be taken from several request threads

    def __reduce__(self):
        # Sent to other ranks of a distributed deployment as its source, recompiled there by
        # the process's compiler for the same model (GrammarCompiler registers itself).
        return _grammar_from_source, (self.source, self._vocab_size, tuple(sorted(self._eos_ids)), self.field)

    def matcher(self) -> Matcher:
        with self._lock:
            state = self._template.deep_copy()
        return Matcher(state, self._vocab_size, self._eos_ids, self.field)


class GrammarCompiler:
    """Compiles grammars for one loaded model; thread-safe; caches by (kind, canonical JSON)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int]):
        hf_tokenizer = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx_lm's TokenizerWrapper wraps the HF one
        self.vocab_size = int(vocab_size)
        self.eos_ids = sorted({int(t) for t in eos_token_ids}) or [hf_tokenizer.eos_token_id]
        # The tokenizer as JSON (what llguidance/hf.py builds from), so the grammar checker's
        # child process builds the same engine tokenizer without transformers.
        backend = copy(hf_tokenizer.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        tokenizer_json = backend.to_str()
        # Ids past the tokenizer (a wider logits row) have no bytes, so the engine never allows them.
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_ids)
        self.sandbox = grammar_sandbox.GrammarSandbox(tokenizer_json, self.vocab_size, self.eos_ids)
        # Added tokens the engine treats as special match no text, only a `<[id]>` reference.
        self._special = {text: token for text, token in hf_tokenizer.get_added_vocab().items()
                         if token < self.vocab_size and self._tokenizer.is_special_token(token)}
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._lock = threading.Lock()
        _COMPILERS[(self.vocab_size, tuple(self.eos_ids))] = self

    def json_object(self) -> Grammar:
        """Any JSON object (OpenAI's {"type": "json_object"})."""
        return self.json_schema({"type": "object"})

    def json_schema(self, schema: dict) -> Grammar:
        """The schema itself (`response_format.json_schema.schema`), not OpenAI's wrapper around it."""
        if not isinstance(schema, dict):
            raise GrammarError("json_schema: the schema must be a JSON object")
        problem = grammar_limits.schema_problem(schema)  # before anything recursive sees it
        if problem:
            raise GrammarLimitError(f"json_schema: {problem}")
        return self._cached("json_schema", schema, lambda: llguidance.LLMatcher.grammar_from_json_schema(
            schema, overrides=JSON_OPTIONS))

    def tool_calls(self, tools: list[dict], *, start: str, end: str, name: str | None, parallel: bool,
                   layout: dict | None = None) -> Grammar:
        """One call (or one or more if `parallel`): start + {"name": ..., "arguments": {...}} + end.

        Each tool is an alternative whose fixed name prefix selects its own arguments schema.
        `layout` (CALL_LAYOUT's keys) is how the model's own format writes a call's name and
        arguments and joins calls: Llama's "parameters", Mistral's `[TOOL_CALLS][...]` list or
        `name[ARGS]{...}`, gpt-oss's `<|channel|>commentary to=functions.NAME ...<|message|>{...}`.
        """
        layout = {**CALL_LAYOUT, **(layout or {})}
        unknown = set(layout) - set(CALL_LAYOUT)
        if unknown:
            raise ValueError(f"unknown tool-call layout keys {sorted(unknown)}")
        functions = _functions(tools)
        for function, parameters in functions.items():  # before anything recursive sees them
            problem = grammar_limits.schema_problem(parameters, f"the parameters schema of function {function!r}")
            if problem:
                raise GrammarLimitError(f"tools: {problem}")
        problem = grammar_limits.total_size_problem(list(functions.values()), "the tools' parameters")
        if problem:
            raise GrammarLimitError(f"tools: {problem}")
        if name is not None:
            if name not in functions:
                raise GrammarError(f"tool_choice names function {name!r}, which is not among the tools")
            functions = {name: functions[name]}
        key = {"tools": functions, "start": start, "end": end, "parallel": parallel, "layout": layout}
        try:
            return self._cached("tool_calls", key,
                                lambda: self._tool_calls_lark(functions, start, end, parallel, layout))
        except GrammarError:
            self._blame_tool(functions)  # a clearer message when one tool's schema is the cause
            raise

    def _blame_tool(self, functions: dict[str, dict]) -> None:
        for function, parameters in functions.items():  # checked in the child too: never compiled here
            source = llguidance.LLMatcher.grammar_from_json_schema(parameters, overrides=JSON_OPTIONS)
            refusal = self.sandbox.check(source)
            if refusal is not None:
                kind = GrammarLimitError if refusal.limit else GrammarError
                raise kind(f"tools: parameters of function {function!r}: {refusal.message}")

    def _tool_calls_lark(self, functions: dict[str, dict], start: str, end: str, parallel: bool,
                         layout: dict) -> str:
        rules, alternatives = [], []
        for i, (function, parameters) in enumerate(functions.items()):
            # each arguments schema is its own %json root, so its "#/$defs/..." refs resolve
            rules.append(f"args_{i}: %json {json.dumps({**parameters, 'x-guidance': JSON_OPTIONS})}")
            spelled = json.dumps(function, ensure_ascii=False) if layout["name_json"] else function
            prefix = layout["name_prefix"] + spelled + layout["arguments_prefix"]
            alternatives.append(" ".join(filter(None, [self._text(prefix), f"args_{i}",
                                                       self._text(layout["arguments_suffix"])])))
        separator = layout["separator"]
        if not parallel:
            calls = "call"
        elif separator is None:
            calls = "call (SEP? call)*"
        else:
            calls = f"call ({self._text(separator)} call)*" if separator else "call+"
        lark = "\n".join([
            "start: " + " ".join(filter(None, [self._text(layout["open"]), calls, self._text(layout["close"])])),
            # bounded, so a model cannot loop on whitespace between calls
            r"SEP: /[ \t\r\n]{1,4}/",
            "call: " + " ".join(filter(None, [self._text(start), "body", self._text(end)])),
            "body: " + " | ".join(alternatives),
            *rules,
        ])
        return llguidance.LLMatcher.grammar_from_lark(lark)

    def _text(self, text: str) -> str:
        """`text` as a Lark sequence; special tokens spelled in it become token references."""
        if not text:
            return ""
        if not self._special:
            return _lark_literal(text)
        pattern = "(" + "|".join(re.escape(s) for s in sorted(self._special, key=len, reverse=True)) + ")"
        parts = [p for p in re.split(pattern, text) if p]
        return " ".join(f"<[{self._special[p]}]>" if p in self._special else _lark_literal(p) for p in parts)

    def _cached(self, kind: str, key_value, build) -> Grammar:
        key = (kind, json.dumps(key_value, sort_keys=True, separators=(",", ":")))
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        grammar = self._compile(kind, build)  # outside the lock: compiles may run in parallel
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, kind: str, build, field: str | None = None, checked: bool = False) -> Grammar:
        """`checked`: the source already passed a checker (another rank's, for the same model)."""
        try:
            source = build()
        except ValueError as exc:  # not a JSON object, or unserialisable
            raise GrammarError(f"{kind}: {_first_line(str(exc))}") from exc
        field = field or FIELDS.get(kind)
        if not checked:
            try:
                refusal = self.sandbox.check(source)
            except grammar_sandbox.CheckerUnavailable as exc:
                raise GrammarCheckerUnavailable(str(exc)) from exc
            if refusal is not None:
                raise (GrammarLimitError if refusal.limit else GrammarError)(f"{kind}: {refusal.message}")
        # The constructor compiles (dropping the GIL) and reports errors as a state, not an exception.
        template = _on_compile_thread(lambda: llguidance.LLMatcher(self._tokenizer, source, log_level=0,
                                                                   limits=_limits()))
        if template.is_error():
            raise GrammarError(f"{kind}: not supported by the grammar engine: {_first_line(template.get_error())}")
        return Grammar(template, self.vocab_size, frozenset(self.eos_ids), source, field)


class GrammarCheckerUnavailable(RuntimeError):
    """The grammar checker process could not start: a server problem (503), not the request's."""


_STACK_LOCK = threading.Lock()


def _on_compile_thread(compile_fn):
    """`compile_fn()` on a new thread with COMPILE_STACK_BYTES of stack: larger than the
    checker's, so a grammar that compiled there cannot overflow here."""
    result: dict = {}

    def run():
        try:
            result["value"] = compile_fn()
        except BaseException as exc:  # a Rust panic arrives as pyo3's PanicException (a BaseException)
            result["error"] = exc

    with _STACK_LOCK:  # the size is process-wide: set it only around this thread's start
        previous = threading.stack_size(grammar_sandbox.COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="grammar-compile")
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in result:
        error = result["error"]
        if isinstance(error, Exception):
            raise error
        raise GrammarError(f"grammar engine failure: {type(error).__name__}: {_first_line(str(error))}")
    return result["value"]


# The compilers built in this process, by (logits width, eos ids): unpickling a Grammar needs one.
_COMPILERS: dict[tuple[int, tuple[int, ...]], GrammarCompiler] = {}
_COMPILERS_LOCK = threading.Lock()


def compiler_for(loaded) -> GrammarCompiler:
    """The process's compiler for a loaded model (built at first use, then shared)."""
    from lockstep.server.engine.decoding.logits_processors import logits_width

    width, eos = logits_width(loaded), tuple(sorted({int(t) for t in loaded.eos_token_ids}))
    with _COMPILERS_LOCK:  # two first requests build one compiler
        compiler = _COMPILERS.get((width, eos)) if eos else None
        return compiler or GrammarCompiler(loaded.tokenizer, width, loaded.eos_token_ids)


def _grammar_from_source(source: str, vocab_size: int, eos_ids: tuple[int, ...], field: str | None = None) -> Grammar:
    compiler = _COMPILERS.get((vocab_size, tuple(eos_ids)))
    if compiler is None:
        raise GrammarError("no grammar compiler for this model in this process")
    return compiler._compile("grammar", lambda: source, field, checked=True)  # rank 0's checker passed it


def _functions(tools: list[dict]) -> dict[str, dict]:
    """OpenAI function tools → {name: parameters schema}."""
    if not tools:
        raise GrammarError("tools: at least one function tool is required")
    functions = {}
    for tool in tools:
        kind = tool.get("type", "function") if isinstance(tool, dict) else type(tool).__name__
        if kind != "function" or not isinstance(tool.get("function"), dict):
            raise GrammarError(f"tools: only function tools are supported, got {kind!r}")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise GrammarError("tools: every function needs a name")
        if name in functions:
            raise GrammarError(f"tools: function name {name!r} appears twice")
        # No parameters: the function takes none, so its arguments are exactly {}.
        parameters = function.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
        problem = grammar_limits.parameters_problem(name, parameters)
        if problem:
            raise GrammarError(f"tools: {problem}")
        # Arguments are an object whatever else the schema says (OpenAI's rule, and what the
        # call parser takes): a schema with no "type" gets "object".
        functions[name] = {**parameters, "type": "object"}
    return functions


def _lark_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # Lark string literals take JSON's escapes
