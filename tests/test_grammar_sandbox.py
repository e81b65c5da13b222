"""The grammar checker's verdict cache (server/engine/structured/grammar_sandbox.py), issue 49 finding 6:
only verdicts the grammar engine returned are cached. A check cut short by the OS (the child
stopped past the timeout, or killed mid-check) says nothing about the grammar, so the same
grammar is checked again, and compiles, when next asked.
"""
import os
import signal

import llguidance
import pytest

from lockstep.server.engine.structured import grammar_sandbox
from lockstep.server.engine.structured.grammar import JSON_OPTIONS, GrammarCompiler, GrammarLimitError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
HANG_GUARD_S = 60


@pytest.fixture(scope="module")
def compiler(embedded_model):
    compiler = GrammarCompiler(embedded_model.tokenizer, embedded_model.model.args.vocab_size,
                               embedded_model.eos_token_ids)
    yield compiler
    compiler.sandbox.close()


def source_of(schema: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)


def running_child(sandbox) -> int:
    """The pid of a checker child that has answered a check."""
    assert sandbox.check(source_of({"type": "boolean"})) is None
    return sandbox.pid


def test_a_schema_whose_check_timed_out_compiles_when_asked_again(compiler):
    os.kill(running_child(compiler.sandbox), signal.SIGSTOP)  # as a suspended or starved process: it never answers
    grammar_sandbox.configure(timeout_s=0.5)
    try:
        with pytest.raises(GrammarLimitError, match="longer than the grammar timeout of 0.5 s"):
            compiler.json_schema(SCHEMA)
    finally:
        grammar_sandbox.configure(timeout_s=grammar_sandbox.DEFAULT_TIMEOUT_S)
    assert compiler.sandbox.pid is None  # the stopped child was killed
    assert not compiler.json_schema(SCHEMA).matcher().finished  # checked again by a fresh child, compiled


def test_a_grammar_whose_checker_was_killed_mid_check_passes_when_asked_again(compiler, monkeypatch):
    sandbox = compiler.sandbox
    source = source_of({**SCHEMA, "properties": {"b": {"type": "string"}}, "required": ["b"]})
    kills = []

    class KilledMidCheck(grammar_sandbox.Connection):
        """The server's end of a child's socket: the child is killed (as by the OOM killer) once
        `source` is on its way to it, before it can answer."""

        def send_bytes(self, data):
            if data != source.encode() or kills:
                return super().send_bytes(data)
            pid = sandbox.pid
            os.kill(pid, signal.SIGSTOP)  # it runs no more code from here
            super().send_bytes(data)
            os.kill(pid, signal.SIGKILL)
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # dead, left for the sandbox to reap
            kills.append(pid)

    monkeypatch.setattr(grammar_sandbox, "Connection", KilledMidCheck)
    sandbox.close()  # the next child's socket is a KilledMidCheck
    running_child(sandbox)
    refusal = sandbox.check(source)
    assert kills and refusal.limit and "crashed compiling this grammar (signal SIGKILL)" in refusal.message
    assert sandbox.check(source) is None  # not the engine's verdict: checked again, by a fresh child
    assert sandbox.pid not in (None, kills[0])


def test_the_engines_own_verdicts_are_cached(compiler):
    """Answered again without the child: a stopped one cannot answer, yet both verdicts come back."""
    sandbox = compiler.sandbox
    fine = source_of(SCHEMA)
    unsupported = source_of({"type": "string", "format": "no-such-format"})
    assert sandbox.check(fine) is None
    refusal = sandbox.check(unsupported)
    assert refusal is not None and not refusal.limit
    pid = sandbox.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        assert sandbox.check(fine) is None and sandbox.check(unsupported) == refusal
        assert sandbox.pid == pid
    finally:
        os.kill(pid, signal.SIGCONT)
