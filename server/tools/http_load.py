"""Load benchmark over HTTP: N streaming clients at once against an OpenAI-compatible server.

For each concurrency level, N clients each send one streamed chat completion (greedy,
fixed max_tokens, different prompts) at the same moment; the round's aggregate tok/s is
all completion tokens over the round's wall time, with p50/p99 time to first token and
inter-token latency over every request and token. Each round's prompts are its own (tagged
with the round), so no server answers a measured round from a prompt it has cached whole. Standard library HTTP only, so the
same code measures lockstep and mlx_lm.server side by side (`lockstep bench --concurrency`).
"""
from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle gear works.",
    "List five uses for a paperclip and explain each.",
    "Describe the water cycle to a child.",
    "What makes a good cup of tea? Give details.",
    "Summarize the plot of a heist movie you invent.",
    "Give advice to someone learning to cook.",
    "Explain why the sky is blue.",
]


@dataclass
class RequestTiming:
    started: float
    first_token: float | None = None
    token_times: list = field(default_factory=list)  # arrival time of each content chunk
    tokens: int = 0
    text: str = ""
    error: str | None = None


@dataclass
class RoundResult:
    concurrency: int
    wall_s: float
    tokens: int
    ttft_s: list
    itl_s: list
    errors: int
    texts: list  # per client index; None where the request failed
    tag: str | None = None  # the round's prompts (`prompt_for`)

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def _percentile(values: list, q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def stream_chat(base_url: str, model: str, prompt: str, max_tokens: int, extra: dict | None = None,
                timeout: float = 600) -> RequestTiming:
    """One streamed chat completion; content chunks are timed as they arrive."""
    url = urllib.parse.urlparse(base_url)
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    timing = RequestTiming(started=time.perf_counter())
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        conn.request("POST", url.path.rstrip("/") + "/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            timing.error = f"HTTP {response.status}: {response.read()[:200]!r}"
            return timing
        usage_tokens = None
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("error"):  # headers were sent before the failure: the stream's last event
                timing.error = f"stream error: {chunk['error'].get('message', '')[:200]}"
                break
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    now = time.perf_counter()
                    timing.first_token = timing.first_token or now
                    timing.token_times.append(now)
                    timing.text += content
                    timing.tokens += 1
        if usage_tokens is not None:
            timing.tokens = usage_tokens
    except OSError as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return timing


def prompt_for(i: int, prompts: list[str] = PROMPTS, tag: str | None = None) -> str:
    """Client i's prompt; a round's `tag` makes its prompts its own."""
    return f"{prompts[i % len(prompts)]} (#{i}{'' if tag is None else f', {tag}'})"


def extra_for(extra, i: int) -> dict:
    """Client i's extra request fields: `extra` is one dict for all clients, or a function of i."""
    return (extra(i) if callable(extra) else extra) or {}


def mixed_extra(i: int) -> dict:
    """Mixed load: even clients deterministic, odd ones not."""
    return {"deterministic": True} if i % 2 == 0 else {}


def solo_texts(base_url: str, model: str, n: int, max_tokens: int, extra=None, tag: str | None = None) -> list:
    """The answers of clients 0..n-1 (of the round tagged `tag`), each sent alone (the
    baseline for changed answers)."""
    return [stream_chat(base_url, model, prompt_for(i, tag=tag), max_tokens, extra_for(extra, i)).text
            for i in range(n)]


def changed_answers(r: RoundResult, solo: list, clients=None) -> int:
    """Greedy answers of this round that differ from the same request sent alone (of
    `clients` only, when given: e.g. the deterministic ones of a mixed round)."""
    return sum(1 for i, text in enumerate(r.texts)
               if text is not None and text != solo[i] and (clients is None or i in clients))


def run_round(base_url: str, model: str, concurrency: int, max_tokens: int, extra=None,
              prompts: list[str] = PROMPTS, tag: str | None = None) -> RoundResult:
    """`concurrency` clients released at once, each with its own prompt (of the round `tag`)."""
    timings: list[RequestTiming | None] = [None] * concurrency
    barrier = threading.Barrier(concurrency)

    def client(i):
        barrier.wait()
        timings[i] = stream_chat(base_url, model, prompt_for(i, prompts, tag), max_tokens, extra_for(extra, i))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    done = [t for t in timings if t is not None and t.error is None]
    ttft = [t.first_token - t.started for t in done if t.first_token is not None]
    itl = []
    for t in done:
        if t.tokens > 1 and len(t.token_times) > 1:
            # per token, between the first and last content chunk
            itl.append((t.token_times[-1] - t.token_times[0]) / (t.tokens - 1))
    return RoundResult(concurrency, wall, sum(t.tokens for t in done), ttft, itl,
                       sum(1 for t in timings if t is None or t.error),
                       [t.text if t is not None and t.error is None else None for t in timings], tag)


MEASURED_ROUNDS = 3  # the fewest measured rounds a figure is the median of


def interleaved_rounds(servers: list[tuple], concurrency: int, max_tokens: int, rounds: int = MEASURED_ROUNDS,
                       after_warm=None) -> list[tuple[RoundResult, list[RoundResult]]]:
    """Warm with warm, for servers up at once, (base_url, model, extra) each: one unmeasured
    round at `concurrency` on each (a server compiles its batched shapes on first use; that
    belongs to no side's figure), then `rounds` (at least MEASURED_ROUNDS) measured ones taken in
    turn (A, B, A, B, ...), so a machine whose speed drifts over minutes moves every side alike.
    Every round has prompts of its own, the same for every server (a repeated prompt would be
    answered from a prompt cache: the measure of one server's cache, not of its serving).
    `after_warm()`, where given, runs between the warm rounds and the measured ones. Returns
    (the median round by aggregate tok/s, all of them) per server."""
    for base_url, model, extra in servers:
        run_round(base_url, model, concurrency, max_tokens, extra, tag=f"{concurrency} clients, warm-up")
    if after_warm is not None:
        after_warm()
    measured = [[] for _ in servers]
    for k in range(max(rounds, MEASURED_ROUNDS)):
        for i, (base_url, model, extra) in enumerate(servers):
            measured[i].append(run_round(base_url, model, concurrency, max_tokens, extra,
                                         tag=f"{concurrency} clients, round {k + 1}"))
    out = []
    for results in measured:
        ordered = sorted(results, key=lambda r: r.tok_per_s)
        out.append((ordered[(len(ordered) - 1) // 2], results))
    return out


def summary_line(name: str, r: RoundResult, changed: int | None = None, of: int | None = None) -> str:
    """One table row; `changed` of `of` answers (default: of all clients)."""
    of = r.concurrency if of is None else of
    return (f"{name:<14} {r.concurrency:>4} {r.tok_per_s:>10.1f} {_percentile(r.ttft_s, .5) * 1e3:>9.0f} "
            f"{_percentile(r.ttft_s, .99) * 1e3:>9.0f} {_percentile(r.itl_s, .5) * 1e3:>8.1f} "
            f"{_percentile(r.itl_s, .99) * 1e3:>8.1f} {r.errors:>6} "
            f"{'-' if changed is None else f'{changed}/{of}':>8}")


HEADER = (f"{'server':<14} {'conc':>4} {'tok/s':>10} {'ttft p50':>9} {'ttft p99':>9} {'itl p50':>8} "
          f"{'itl p99':>8} {'errors':>6} {'changed':>8}   (ms; changed: greedy answers that differ "
          f"from the same request alone)")


def _health(body: bytes) -> dict:
    try:
        health = json.loads(body)
    except ValueError:
        return {}
    return health if isinstance(health, dict) else {}


def _starting(body: bytes) -> bool:
    """Whether lockstep's /health says start-up work goes on: the guarantee's proofs, or the audit
    stages, the draft model and the batched-sampling proof after them (until that one has run,
    deterministic rows sample one at a time)."""
    health = _health(body)
    return health.get("guarantee") == "proving" or health.get("starting") is True


AHEAD_METRIC = 'lockstep_decode_ahead_passes_total{outcome="'
PASS_METRIC = "lockstep_decode_pass_seconds"


def _metrics(base_url: str) -> str:
    """A lockstep server's /metrics text (OSError where it does not answer)."""
    url = urllib.parse.urlparse(base_url)
    if not url.hostname:
        raise OSError(f"no server at {base_url!r}")
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    conn.request("GET", "/metrics")
    return conn.getresponse().read().decode()


def _labelled(text: str, head: str) -> dict[str, float]:
    """The samples of /metrics text whose line starts with `head` (a name and its one label's
    opening quote), by that label's value."""
    return {line[len(head):].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(head)}


def decode_ahead_line(base_url: str) -> str:
    """A lockstep server's decode passes built ahead, taken over and dropped so far (its
    /metrics): "built 90, taken 88, dropped 2", or "unknown (why)"."""
    try:
        text = _metrics(base_url)
    except OSError as exc:
        return f"unknown ({exc})"
    counts = _labelled(text, AHEAD_METRIC)
    return ", ".join(f"{outcome} {int(count)}" for outcome, count in counts.items()) or "unknown (no such metric)"


def pass_seconds(base_url: str) -> dict | None:
    """A lockstep server's decode passes so far by kind, from /metrics: {kind: (passes,
    seconds)}; None where it does not answer or has no such metric."""
    try:
        text = _metrics(base_url)
    except OSError:
        return None
    counts = _labelled(text, f'{PASS_METRIC}_count{{kind="')
    sums = _labelled(text, f'{PASS_METRIC}_sum{{kind="')
    return {kind: (int(count), sums.get(kind, 0.0)) for kind, count in counts.items()} or None


def pass_seconds_line(before: dict | None, after: dict | None) -> str:
    """The decode passes between two `pass_seconds` readings, by kind: "deterministic 380 passes,
    9.71 ms each; plain 0", or "unknown"."""
    if before is None or after is None:
        return "unknown"
    parts = []
    for kind, (count, seconds) in sorted(after.items()):
        passes = count - before.get(kind, (0, 0.0))[0]
        spent = seconds - before.get(kind, (0, 0.0))[1]
        parts.append(f"{kind} {passes} passes, {1e3 * spent / passes:.2f} ms each" if passes else f"{kind} 0")
    return "; ".join(parts)


def wait_healthy(base_url: str, path: str, timeout: float, proc=None) -> None:
    """Until `path` answers 200 (for lockstep's /health: with its start-up work done too, since a
    server proves and audits after serving starts and a measurement wants the deployment it
    describes). Raises at once where lockstep's /health says its engine failed."""
    url = urllib.parse.urlparse(base_url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection(url.hostname, url.port, timeout=5)
            conn.request("GET", path)
            response = conn.getresponse()
            body = response.read()
            if response.status == 200 and not (path == "/health" and _starting(body)):
                return
            if response.status == 503 and _health(body).get("status") == "failed":
                raise RuntimeError(f"{base_url}{path}: the engine failed: {_health(body).get('error')}")
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{base_url}{path} did not answer within {timeout:.0f} s")
