"""Where one HTTP stream loses time against the engine's own loop (issue 50), in one process.

The same engine runs one request two ways, rounds alternating after one unmeasured round:
  engine  tokens taken straight from the engine's handle on an asyncio loop (no HTTP);
  http    the same request streamed over HTTP (`lockstep serve`'s app on uvicorn, loopback)
          and read with the official `openai` client (`chat.completions.create(stream=True)`).

The engine runs a stub model runner by default (`--runner fixed`, this bench only): each decode
step holds the GIL for --host-ms (building the next pass, as the real runner's Python does
while the device runs the one submitted: decode ahead) and waits for a device that takes
--step-ms a pass, so a step costs max(host, device) when nothing else wants the GIL. Its
tokens are a real text's tokens of the embedded model's tokenizer (real detokenization).
`--runner model`: the model itself (--model: the embedded one by default, or any model
`lockstep serve` takes), its KV pool as `serve --kv-pool auto` picks it.

    python bench/stream_path.py [--runner fixed|model] [--step-ms 1.5] [--host-ms 4]
                                [--tokens 200] [--rounds 3] [--model default] [--client-process]

Reports, each the median over rounds: ms a token from the first token to the last (engine
and http) and their ratio, then the http stream's parts per token: CPU time of each part on
its thread (engine thread: the step, the scheduler's bookkeeping, detokenization, handing the
deltas to the event loop; event loop: the wake-up's queue hand-off, the route's chunk objects,
JSON + SSE framing, uvicorn's send and socket write, the rest of the loop; client: the openai
client's read and parse) and the wake-up's latency (engine thread's post to the loop running
it), and the socket writes a token. Measures and prints; asserts nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from lockstep.server.engine.runner.model_runner import ModelRunner  # noqa: E402
from lockstep.server.engine.runner.step_data import PassResult, PrefillResult  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog. A stream of tokens leaves the engine, "
        "crosses the event loop, becomes a chunk of JSON, is framed as a server-sent event and "
        "written to a socket, where a client reads and parses it again. ")


class FixedStepRunner(ModelRunner):
    """A model runner whose decode passes take `step_s` of device time and `host_s` of Python
    (GIL held) to build, overlapped as decode ahead overlaps them; prompts cost nothing. Each
    request's tokens follow `script` (never an end-of-sequence token). Bench only."""

    def __init__(self, model, script: list[int], step_s: float, host_s: float):
        self.model = model
        from lockstep.server.engine.guarantee.deployment import Deployment

        self.deployment = Deployment()
        self.batching_problem = None
        self.kv_pool = self.compiled = self._ahead = None
        self.ahead_built = self.ahead_taken = self.ahead_dropped = 0
        self.script, self.step_s, self.host_s = script, step_s, host_s
        self._device_done = None  # when the pass on the device now finishes

    def prefill(self, state) -> PrefillResult:
        step = state.next_prefill()
        return PrefillResult(len(step.tokens), step.model, follow=step.follow)

    def prefill_shared(self, states) -> list[int]:
        return [len(state.next_chunk()) for state in states]

    def decode(self, decode_pass, look_ahead: bool = False) -> PassResult:
        start = time.perf_counter()
        if self._device_done is None or not look_ahead:  # nothing submitted ahead: this pass first
            self._device_done = start + self.step_s
        _spin(self.host_s)  # the next pass, built while the device runs this one
        after = max(time.perf_counter(), self._device_done) + self.step_s
        _sleep_until(self._device_done)
        self._device_done = after if look_ahead else None
        argmax = [self.script[state.generated % len(self.script)] for slot, _ in decode_pass.members
                  for state in (slot.state,)]
        rows = len(argmax)
        spans = [(i, i + 1) for i in range(rows)]
        return PassResult(mx.zeros((rows, 1)), argmax, [None] * rows, spans)


def _spin(seconds: float) -> None:
    """`seconds` of this thread's CPU in Python: longer in wall time while other threads hold the GIL."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _sleep_until(when: float) -> None:
    left = when - time.perf_counter()
    if left > 0:
        time.sleep(left)


class Parts:
    """Per-part CPU seconds (thread time of the thread that ran it) and counts."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.latency: list[float] = []
        self.writes = 0  # response body writes
        self.enabled = False

    def add(self, part: str, seconds: float) -> None:
        if self.enabled:
            self.seconds[part] += seconds

    def clear(self) -> None:
        self.seconds.clear()
        self.latency.clear()
        self.writes = 0


PARTS = Parts()
THREADS: dict[str, threading.Thread] = {}  # the engine's worker thread, once it ran a step


def timed(part: str, fn):
    def wrapper(*args, **kwargs):
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            PARTS.add(part, time.thread_time() - start)
    wrapper.__wrapped__ = fn
    return wrapper


def async_timed_send(app):
    """ASGI wrapper: CPU time in uvicorn's `send` of response bodies (h11 framing, socket write)."""
    async def wrapped(scope, receive, send):
        async def timed_send(message):
            start = time.thread_time()
            try:
                await send(message)
            finally:
                if message["type"] == "http.response.body":
                    PARTS.add("loop: uvicorn send + socket write", time.thread_time() - start)
                    PARTS.writes += PARTS.enabled and bool(message.get("body"))
        return await app(scope, receive, timed_send)
    return wrapped


def instrument() -> None:
    """Wrap the parts of the path in timers (thread CPU time)."""
    import lockstep.server.api.chat as chat_module
    import lockstep.server.api.completions as completions_module
    import lockstep.server.api.sse as sse_module
    import lockstep.server.engine.engine as engine_module
    import lockstep.server.engine.scheduling.handle as handle_module
    from lockstep.server.engine.scheduling.scheduler import Scheduler
    from lockstep.server.engine.decoding.stops import IncrementalDecoder

    FixedStepRunner.decode = timed("engine: step (host build; model: the pass)", FixedStepRunner.decode)
    ModelRunner.decode = timed("engine: step (host build; model: the pass)", ModelRunner.decode)
    update = timed("engine: scheduler update (take)", Scheduler.update_from_output)

    def update_from_output(self, output, result):
        THREADS["engine"] = threading.current_thread()
        return update(self, output, result)
    Scheduler.update_from_output = update_from_output
    Scheduler.schedule_decode = timed("engine: scheduler schedule", Scheduler.schedule_decode)
    IncrementalDecoder.add = timed("engine: detokenization", IncrementalDecoder.add)
    engine_module.post_all = timed("engine: hand-off (post_all)", engine_module.post_all)
    for module in (chat_module, completions_module):
        for name in ("ChatDelta", "ChatChunkChoice", "ChatCompletionChunk", "TextCompletion", "CompletionChoice"):
            if hasattr(module, name):  # the endpoints' own names for the response bodies
                setattr(module, name, timed("loop: chunk objects (pydantic)", getattr(module, name)))
    try:  # chunks rendered from a template (server/api/chunk_json.py), where the server has it
        from lockstep.server.api.chunk_json import ChunkTemplate

        ChunkTemplate.render = timed("loop: chunk JSON (template)", ChunkTemplate.render)
    except ImportError:
        pass
    sse_module.event = timed("loop: JSON + SSE framing", sse_module.event)
    original_deliver = handle_module._deliver

    def deliver(items, posted=None):
        if posted is not None and PARTS.enabled:
            PARTS.latency.append(time.perf_counter() - posted)
        return original_deliver(items)
    handle_module._deliver = timed("loop: wake-up (deliver)", deliver)
    original_post_all = handle_module.post_all

    def post_all(posts):
        # the posting time rides along, for the wake-up's latency
        by_loop = defaultdict(list)
        for handle, events in posts:
            target = handle.deliver_via(events) if events else None
            if target is not None:
                by_loop[target._loop].append((target, events))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(handle_module._deliver, items, time.perf_counter())
    post_all.__wrapped__ = original_post_all
    engine_module.post_all = timed("engine: hand-off (post_all)", post_all)


def thread_cpu(thread: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


@contextlib.contextmanager
def serving(app):
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="uvicorn")
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", thread
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def engine_round(engine, prompt: list[int], tokens: int) -> tuple[float, str]:
    """ms a token from first to last, tokens straight from the engine's handle; the text."""
    from lockstep.server.engine.decoding.request_state import GenerationRequest
    from lockstep.server.engine.decoding.sampling import SamplingParams

    async def run():
        handle = engine.submit(GenerationRequest(prompt_tokens=prompt, max_tokens=tokens,
                                                 sampling=SamplingParams(temperature=0.0)))
        stamps, text = [], []
        async for delta in handle:
            if delta.text:
                stamps.append(time.perf_counter())
                text.append(delta.text)
        return (stamps[-1] - stamps[0]) * 1e3 / (len(stamps) - 1), "".join(text)
    return asyncio.run(run())


def http_round(client, messages, tokens: int) -> tuple[float, str, int]:
    stamps, text = [], []
    stream = client.chat.completions.create(model="default", messages=messages, max_tokens=tokens,
                                            temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
    return (stamps[-1] - stamps[0]) * 1e3 / (len(stamps) - 1), "".join(text), len(stamps)


def child_http_round(url: str, messages, tokens: int) -> tuple[float, str, int, float]:
    """`http_round` in a child process (its client's CPU off this process's GIL); also the
    child's CPU seconds in the round."""
    import json
    import subprocess

    script = (f"import json, sys, time; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); "
              "from stream_path import http_round; from openai import OpenAI; "
              f"c = OpenAI(base_url={url + '/v1'!r}, api_key='x', max_retries=0); "
              f"start = time.process_time(); r = http_round(c, {messages!r}, {tokens}); "
              "print(json.dumps([*r, time.process_time() - start]))")
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout
    ms, text, count, cpu = json.loads(out.strip().splitlines()[-1])
    return ms, text, count, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runner", choices=("fixed", "model"), default="fixed")
    # The defaults: a host-bound step like the 8B 4-bit pass on the H200 (its weights read in
    # ~1 ms, the engine's loop at ~5 ms a token).
    parser.add_argument("--step-ms", type=float, default=1.5, help="device time a decode pass (fixed runner)")
    parser.add_argument("--host-ms", type=float, default=4.0,
                        help="Python (GIL held) a decode pass takes to build (fixed runner)")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="default")
    parser.add_argument("--client-process", action="store_true",
                        help="the openai client in a child process (its parsing off this process's GIL)")
    args = parser.parse_args()

    from openai import OpenAI

    from lockstep.models.load import load_model
    from lockstep.server.api.app import create_app
    from lockstep.server.engine import Engine

    instrument()
    loaded = load_model(args.model)
    runner = None
    if args.runner == "fixed":
        script = [t for t in loaded.tokenizer.encode(TEXT) if t not in loaded.eos_token_ids]
        runner = FixedStepRunner(loaded.model, script, args.step_ms / 1e3, args.host_ms / 1e3)
    deployment = None
    if args.runner == "model":  # as serve runs it: the KV pool's kernel where there is one, so
        # decode passes run compiled and are built ahead
        from lockstep.kernels.batching.pool_mode import pool_mode
        from lockstep.server.engine.guarantee.deployment import Deployment

        deployment = Deployment(kv_pool=pool_mode(loaded.model, "auto"))
    engine = Engine(loaded, max_active=4, runner=runner, deployment=deployment).start()
    messages = [{"role": "user", "content": "Write a long story about a fox."}]
    prompt = list(loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    results: dict[str, list[float]] = defaultdict(list)
    parts_per_round: list[dict[str, float]] = []
    texts = {}
    try:
        with serving(async_timed_send(create_app(engine))) as (url, loop_thread):
            client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            for round_ in range(args.rounds + 1):
                measured = round_ > 0
                ms, texts["engine"] = engine_round(engine, prompt, args.tokens)
                if measured:
                    results["engine"].append(ms)
                PARTS.clear()
                PARTS.enabled = measured
                engine_thread = THREADS.get("engine")
                cpu0 = {"loop": thread_cpu(loop_thread), "client": time.thread_time(),
                        **({"engine": thread_cpu(engine_thread)} if engine_thread else {})}
                if args.client_process:
                    ms, texts["http"], count, client_cpu = child_http_round(url, messages, args.tokens)
                else:
                    ms, texts["http"], count = http_round(client, messages, args.tokens)
                cpu1 = {"loop": thread_cpu(loop_thread), "client": time.thread_time(),
                        **({"engine": thread_cpu(engine_thread)} if engine_thread else {})}
                if args.client_process:  # the child's whole CPU (its imports excluded)
                    cpu1["client"] = cpu0["client"] + client_cpu
                PARTS.enabled = False
                if not measured:
                    continue
                results["http"].append(ms)
                per = {k: v * 1e3 / count for k, v in PARTS.seconds.items()}
                for thread in cpu0:
                    per[f"{thread} thread: all CPU"] = (cpu1[thread] - cpu0[thread]) * 1e3 / count
                per["wake-up latency (post -> loop runs it)"] = statistics.median(PARTS.latency) * 1e3
                per["socket writes a token (count)"] = PARTS.writes / count
                parts_per_round.append(per)
    finally:
        engine.stop()

    engine_ms, http_ms = statistics.median(results["engine"]), statistics.median(results["http"])
    print(f"runner {args.runner}" + (f" (device {args.step_ms} ms, host {args.host_ms} ms a step)"
                                     if args.runner == "fixed" else f" ({loaded.name})")
          + f", {args.tokens} tokens, median of {args.rounds} rounds after one warm-up"
          + (", client in a child process" if args.client_process else ""))
    print(f"same text both ways: {texts['engine'] == texts['http']}")
    print(f"{'engine loop':<44} {engine_ms:8.3f} ms/token   rounds {[round(x, 3) for x in results['engine']]}")
    print(f"{'http stream (openai client)':<44} {http_ms:8.3f} ms/token   rounds {[round(x, 3) for x in results['http']]}")
    print(f"{'ratio http / engine':<44} {http_ms / engine_ms:8.3f}")
    print("\nper token on the http stream (median over rounds; CPU time of the thread that ran it):")
    keys = sorted({k for per in parts_per_round for k in per})
    order = sorted(keys, key=lambda k: (k.split(":")[0].split(" ")[0] not in ("engine",),
                                        "thread" in k, "latency" in k, k))
    for key in order:
        values = [per.get(key, 0.0) for per in parts_per_round]
        print(f"  {key:<48} {statistics.median(values):8.4f}" + ("" if "count" in key else " ms"))


if __name__ == "__main__":
    main()
