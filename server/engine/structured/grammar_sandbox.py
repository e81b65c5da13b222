"""The grammar checker: every grammar a request brings is compiled first in a child process, so
that a grammar-engine crash ends the child, never the server.

Why: llguidance compiles a grammar recursively on the calling thread's stack, and Rust code
does not raise on a stack overflow or a failed allocation, it ends the process. One request's
schema (a chain of ~1,000 `$ref`s) could so kill the server with every request in it.
grammar_limits.py refuses the known shapes cheaply; this is the net behind it.

How: one long-lived child per compiler checks each grammar source (compile, then the first
token mask and one step past a few of the allowed tokens, where some engine limits show):
- on a thread with a stack of CHECK_STACK_BYTES, smaller than the server's compile threads'
  (COMPILE_STACK_BYTES, used by grammar.py) and than an engine thread's default, so a grammar
  that passed here cannot overflow there (same engine code, same frames);
- under an address-space limit (GRAMMAR_MEMORY_BYTES, where the OS enforces RLIMIT_AS);
- within a time limit (`--grammar-timeout`), after which the child is killed; the next check
  starts a fresh one.
A child that dies or runs out of time is a refusal of that grammar (an HTTP 400). Verdicts the
engine itself returned are cached by the source's digest, so a repeated schema costs nothing; a
death or a timeout is not cached (the OS may have killed, stopped or starved the child for
reasons of its own), so the grammar is checked again when next asked.

The child is a fresh interpreter running this file as a script (`python -P`): never a fork of
the server, whose MLX threads a fork would copy half-way; no `lockstep` package import either,
so it loads llguidance and nothing of MLX. Its tokenizer is rebuilt from the HF tokenizer's
JSON (as llguidance/hf.py does), so it needs no transformers. It works the same when
`lockstep serve` runs as a launchd service. It exits when the server's end of its socket closes
or the server is gone.
"""
from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing.connection import Connection

CHECK_STACK_BYTES = 4 << 20  # the child's compile thread
COMPILE_STACK_BYTES = 64 << 20  # the server's compile threads (grammar.py): well above the child's
GRAMMAR_MEMORY_BYTES = 2 << 30  # the child's address space
DEFAULT_TIMEOUT_S = 10.0  # one grammar's check; `lockstep serve --grammar-timeout`
STARTUP_TIMEOUT_S = 120.0  # a child loading a large tokenizer on a busy machine
PROBE_TOKENS = 8  # allowed first tokens stepped past in the check
VERDICTS = 1024  # cached verdicts per checker
ERROR_CHARS = 300

_settings = {"timeout_s": DEFAULT_TIMEOUT_S}


def configure(timeout_s: float | None = None) -> None:
    """Process-wide settings (`lockstep serve` flags), for checkers built before or after."""
    if timeout_s is not None:
        if not timeout_s > 0:
            raise ValueError("--grammar-timeout must be > 0")
        _settings["timeout_s"] = float(timeout_s)


@dataclass(frozen=True)
class Refusal:
    message: str  # safe to show to the client
    limit: bool  # a grammar-engine limit (crash, time, memory, parser/lexer), not an unsupported feature


class CheckerUnavailable(RuntimeError):
    """The checker process could not be started (a server problem, not the request's)."""


class GrammarSandbox:
    """Checks grammar sources in a child process; thread-safe (checks run one at a time)."""

    def __init__(self, tokenizer_json: str, n_vocab: int, eos_ids: list[int]):
        self._init = json.dumps({"tokenizer": tokenizer_json, "n_vocab": n_vocab, "eos": list(eos_ids),
                                 "stack": CHECK_STACK_BYTES, "memory": GRAMMAR_MEMORY_BYTES,
                                 "probe": PROBE_TOKENS}).encode()
        self._lock = threading.Lock()
        self._child: list = []  # [(process, connection)] while one runs
        self._verdicts: OrderedDict[bytes, Refusal | None] = OrderedDict()
        weakref.finalize(self, _stop, self._child)

    def check(self, source: str) -> Refusal | None:
        """None if the engine compiles `source` and starts it; else why not."""
        key = hashlib.sha256(source.encode()).digest()
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                return self._verdicts[key]
            verdict, returned = self._run(source)
            if returned:
                self._verdicts[key] = verdict
                while len(self._verdicts) > VERDICTS:
                    self._verdicts.popitem(last=False)
            return verdict

    def close(self) -> None:
        with self._lock:
            _stop(self._child)

    @property
    def pid(self) -> int | None:
        """The child's process id while one runs (tests)."""
        return self._child[0][0].pid if self._child else None

    def _run(self, source: str) -> tuple[Refusal | None, bool]:
        """The verdict, and whether the engine returned it (False: the child died or timed out)."""
        process, conn = self._started()
        timeout = _settings["timeout_s"]
        try:
            conn.send_bytes(source.encode())
            if not conn.poll(timeout):
                _stop(self._child)
                return Refusal(f"compiling the grammar took longer than the grammar timeout of {timeout:g} s "
                               "(lockstep serve --grammar-timeout)", limit=True), False
            result = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return self._died(process), False
        if "error" not in result:
            return None, True
        return _refusal(result["stage"], result["error"][:ERROR_CHARS]), True

    def _died(self, process: subprocess.Popen) -> Refusal:
        _stop(self._child)
        code = process.returncode
        how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 and -code in \
            signal.valid_signals() else f"exit status {code}"
        return Refusal(f"the grammar engine crashed compiling this grammar ({how}): it is past the engine's "
                       f"limits (stack {CHECK_STACK_BYTES >> 20} MiB, memory {GRAMMAR_MEMORY_BYTES >> 20} MiB); "
                       "nest it less (directly or through $ref) or make it smaller", limit=True)

    def _started(self) -> tuple[subprocess.Popen, Connection]:
        if self._child and self._child[0][0].poll() is None:
            return self._child[0]
        _stop(self._child)
        ours, theirs = socket.socketpair()
        try:
            process = subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__), str(theirs.fileno())],
                                       pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL)
        except OSError as exc:
            ours.close()
            raise CheckerUnavailable(f"the grammar checker could not start: {exc}") from exc
        finally:
            theirs.close()
        conn = Connection(ours.detach())
        self._child.append((process, conn))
        try:
            conn.send_bytes(self._init)
            if not conn.poll(STARTUP_TIMEOUT_S) or conn.recv_bytes() != b"ready":
                raise EOFError
        except (EOFError, OSError) as exc:
            _stop(self._child)
            raise CheckerUnavailable(f"the grammar checker did not start (exit status {process.returncode})") \
                from exc
        return process, conn


def first_line(message: str) -> str:
    """An engine message's first line, without its advice to grammar authors."""
    line = message.strip().splitlines()[0] if message.strip() else "grammar engine error"
    return line.split("; consider making your grammar")[0]


def _refusal(stage: str, error: str) -> Refusal:
    if stage == "compile":
        return Refusal(f"not supported by the grammar engine: {error}", limit=False)
    if stage == "empty":
        return Refusal(f"the grammar admits no output (for example a $ref that only refers to itself): {error}",
                       limit=False)
    return Refusal(f"the grammar engine hits one of its limits at the start of the output: {error}", limit=True)


def _stop(child: list) -> None:
    while child:
        process, conn = child.pop()
        conn.close()  # the child exits on EOF; a stuck one is killed
        if process.poll() is None:
            process.kill()
        process.wait()


# ------------------------------------------------------------------------ the child process

def _check(llguidance, tokenizer, source: str, settings: dict) -> dict:
    """compile → first mask → one step past up to `probe` allowed tokens, each on a copy."""
    limits = llguidance.LLParserLimits(verbose_errors=False)
    matcher = llguidance.LLMatcher(tokenizer, source, log_level=0, limits=limits)
    if matcher.is_error():
        return {"stage": "compile", "error": first_line(matcher.get_error())}
    mask = matcher.compute_bitmask()
    if matcher.is_error():
        error = first_line(matcher.get_error())
        stage = "empty" if {error, matcher.stop_reason()} & {"NoExtension", "NoExtensionBias"} else "start"
        return {"stage": stage, "error": error}
    allowed = _first_allowed(mask, settings["n_vocab"], len(settings["eos"]) + settings["probe"])
    if not allowed:
        return {"stage": "empty", "error": "no token is allowed first"}
    for token in [t for t in allowed if t not in settings["eos"]][:settings["probe"]]:
        step = matcher.deep_copy()
        if step.consume_token(token):
            step.compute_bitmask()
        if step.is_error():
            return {"stage": "probe", "error": first_line(step.get_error())}
    return {}


def _first_allowed(mask: bytes, n_vocab: int, count: int) -> list[int]:
    """The first `count` token ids whose bit is set (little-endian bits, as the engine writes them)."""
    tokens = []
    for index, byte in enumerate(mask):
        while byte and len(tokens) < count:
            bit = (byte & -byte).bit_length() - 1
            if index * 8 + bit < n_vocab:
                tokens.append(index * 8 + bit)
            byte &= byte - 1
        if len(tokens) >= count:
            break
    return tokens


def _limit_memory(limit: int) -> None:
    try:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    except (ValueError, OSError):  # not settable here (some macOS versions): the timeout still bounds it
        pass


def _exit_with(parent: int) -> None:
    """The child ends when the server does, even mid-check (a killed server sends no EOF then)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _child_main(fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the server's to handle
    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    conn = Connection(fd)
    settings = json.loads(conn.recv_bytes())
    import llguidance

    tokenizer = llguidance.LLTokenizer(settings["tokenizer"], n_vocab=settings["n_vocab"], eos_token=settings["eos"])
    del settings["tokenizer"]
    _limit_memory(settings["memory"])
    threading.stack_size(settings["stack"])  # every check thread from here on
    conn.send_bytes(b"ready")
    while True:
        try:
            source = conn.recv_bytes().decode()
        except EOFError:  # the server closed its end (or exited)
            return
        result: dict = {}

        def run():
            try:
                result.update(_check(llguidance, tokenizer, source, settings))
            except BaseException as exc:  # a Rust panic arrives as pyo3's PanicException
                result.update(stage="compile", error=f"{type(exc).__name__}: {first_line(str(exc))}")

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        conn.send_bytes(json.dumps(result).encode())


if __name__ == "__main__":
    _child_main(int(sys.argv[1]))
