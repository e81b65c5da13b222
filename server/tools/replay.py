"""Replay recorded requests (`lockstep serve --record`) against a running server and compare
each answer with the recorded one (`lockstep replay`, server/commands/replay.py).

Each recorded request is sent again, unstreamed, with `return_token_ids`, and each choice is:
- `identical`: the same token ids;
- `diverged`: the first differing token's index and both tokens;
- `not comparable`: the answers need not agree, said with the reason: another model (weights
  digest), another `system_fingerprint` or L, or the guarantee did not cover one of them;
- `failed`: the server did not answer (the HTTP status and its message).
Only comparable answers count: the exit status is 0 when each of them is identical.
"""
from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from typing import Iterable, Iterator

IDENTICAL, DIVERGED, NOT_COMPARABLE, FAILED = "identical", "diverged", "not comparable", "failed"
# What two receipts must share for their answers to be compared, and how a difference is said.
SAME_DEPLOYMENT = (("model", "another model (weights digest)"),
                   ("system_fingerprint", "another system_fingerprint (kernels, backend, MLX or settings)"),
                   ("batch_invariant_limit", "another batch-invariant limit L"))


@dataclass
class Verdict:
    line: int  # 1-based line in its file
    file: str
    choice: int
    outcome: str
    reason: str = ""
    index: int | None = None  # diverged: the first differing token
    recorded: int | None = None
    replayed: int | None = None


def entries(paths: Iterable[str]) -> Iterator[tuple[str, int, dict]]:
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    yield path, number, json.loads(line)


def comparable(recorded: dict | None, replayed: dict | None) -> str:
    """'' when the two receipts' answers must be identical, else why not."""
    if not recorded or not replayed:
        return "a receipt is missing"
    for field, reason in SAME_DEPLOYMENT:
        if recorded.get(field) != replayed.get(field):
            return f"{reason}: recorded {recorded.get(field)!r}, replayed {replayed.get(field)!r}"
    if not (recorded.get("deterministic") and recorded.get("guaranteed")):
        return "the recorded answer was not covered by the determinism guarantee"
    if not (replayed.get("deterministic") and replayed.get("guaranteed")):
        return "the replayed answer was not covered by the determinism guarantee"
    return ""


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def judge(recorded: dict, replayed: dict | None, where: tuple[str, int]) -> Verdict:
    file, line = where
    index = recorded["index"]
    lockstep = (replayed or {}).get("lockstep") or {}
    why = comparable(recorded.get("receipt"), lockstep.get("receipt"))
    if why:
        return Verdict(line, file, index, NOT_COMPARABLE, why)
    ours, theirs = recorded["token_ids"], lockstep.get("token_ids") or []
    at = first_difference(ours, theirs)
    if at is None:
        return Verdict(line, file, index, IDENTICAL)
    pick = lambda tokens: tokens[at] if at < len(tokens) else None  # noqa: E731
    return Verdict(line, file, index, DIVERGED, f"token {at} differs", at, pick(ours), pick(theirs))


def request_for(entry: dict, speculation: bool) -> dict:
    body = {k: v for k, v in entry["request"].items() if k not in ("stream", "stream_options")}
    body["return_token_ids"] = True
    if not speculation:  # by the guarantee the answer does not depend on it
        for field in ("speculative", "num_draft_tokens", "prediction"):
            body.pop(field, None)
    return body


def post(url: str, path: str, body: dict, api_key: str | None, timeout: float) -> dict:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url.rstrip("/") + path, json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def replay(paths: list[str], url: str, *, api_key: str | None = None, speculation: bool = True,
           timeout: float = 600.0, progress=None) -> list[Verdict]:
    """Every recorded choice's verdict, in file order."""
    verdicts = []
    # read whole first: a server that records into the same file must not feed the replay its own lines
    for file, line, entry in list(entries(paths)):
        try:
            answer = post(url, entry["endpoint"], request_for(entry, speculation), api_key, timeout)
        except urllib.error.HTTPError as exc:
            reason = f"HTTP {exc.code}: {exc.read()[:300].decode(errors='replace')}"
            verdicts += [Verdict(line, file, c["index"], FAILED, reason) for c in entry["choices"]]
        except (urllib.error.URLError, OSError) as exc:
            verdicts += [Verdict(line, file, c["index"], FAILED, str(exc)) for c in entry["choices"]]
        else:
            for recorded in entry["choices"]:
                verdicts.append(judge(recorded, answer["choices"][recorded["index"]], (file, line)))
        if progress is not None:
            progress(len(verdicts))
    return verdicts


def summary(verdicts: list[Verdict]) -> str:
    counts = {o: sum(v.outcome == o for v in verdicts) for o in (IDENTICAL, DIVERGED, NOT_COMPARABLE, FAILED)}
    lines = ["| outcome | answers |", "|---|---|"] + [f"| {o} | {n} |" for o, n in counts.items()]
    for v in verdicts:
        if v.outcome != IDENTICAL:
            detail = (f"token {v.index}: recorded {v.recorded}, replayed {v.replayed}"
                      if v.outcome == DIVERGED else v.reason)
            lines.append(f"{v.file}:{v.line} choice {v.choice}: {v.outcome} ({detail})")
    return "\n".join(lines)


def exit_status(verdicts: list[Verdict]) -> int:
    return 0 if all(v.outcome in (IDENTICAL, NOT_COMPARABLE) for v in verdicts) else 1


def as_json(verdicts: list[Verdict]) -> str:
    return json.dumps([asdict(v) for v in verdicts], indent=1)


def print_progress(total: int):
    def show(done: int) -> None:
        sys.stderr.write(f"\rreplayed {done}/{total} answers")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()
    return show


def count_choices(paths: list[str]) -> int:
    return sum(len(entry["choices"]) for _, _, entry in entries(paths))

