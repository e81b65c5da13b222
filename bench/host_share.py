"""The host's share of a token at many streams (issue 50): lockstep's own work per row and per
token when the model costs almost nothing, split by thread, over HTTP and without it.

A tiny random llama (tests/synthetic.py's chat model at hidden 128, 2 layers, a byte-level
tokenizer with a chat template) is served by `lockstep serve`'s own assembly in a server
process per variant; this process is the load (tools/http_load.py's streaming clients,
threads of their own, off the server's GIL). Each variant is a source tree (`--tree
NAME=PATH`, e.g. a `git archive` of the commit before a change), so two versions of the code
are measured side by side: after one unmeasured round of each, rounds alternate A, B, A, B.
Per round the server reports its threads' CPU time (engine thread, event loop thread, the
process) and this process counts the tokens: µs of CPU per token on each thread, aggregate
tok/s, ms per token per stream (median inter-token latency). `--engine-only`: the same N
requests submitted straight to the engine in the server process (no HTTP).

    python bench/host_share.py [--tree base=/tmp/base --tree new=.] [--limit 0] [--deterministic]
                               [--streams 1,16,32] [--tokens 64] [--rounds 3] [--temperature 0]

Measures and prints; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "server" / "tools"))
sys.path.insert(0, str(ROOT / "bench"))

import http_load  # noqa: E402  (stdlib only: the load side never imports lockstep or MLX)
from harness import drive  # noqa: E402  (imports no lockstep: the server side runs any --tree's)


# ----------------------------------------------------------------------------- server side

def thread_cpu(thread: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def serve_child(args) -> None:
    """The server process: `lockstep serve`'s assembly on uvicorn in a thread; answers the
    parent's commands on stdin, one JSON line each."""
    import asyncio
    import socket

    import uvicorn

    from lockstep.server.cli import build_parser
    from lockstep.server.commands.serve import build_app_from_args

    import logging

    logging.basicConfig(level=logging.WARNING)
    argv = ["serve", "--model", args.model, "--batch-invariant-limit", str(args.limit),
            "--max-active", str(args.max_streams), "--max-batch-rows", str(args.max_streams)]
    if args.gpu_path:  # the KV pool's kernel by the CPU stand-in: passes compiled and decoded ahead
        sys.path.insert(0, str(ROOT))
        from tests.doubles.pool_kernel import pool_kernel_double

        pool_kernel_double().__enter__()  # for the process's life
        from lockstep.kernels.batching import pool_mode as pool_mode_module

        pool_mode_module.kernel_unavailable_reason = lambda *args, **kwargs: None  # its own name for it
        argv += ["--kv-pool", "on"]
    app, engine = build_app_from_args(build_parser().parse_args(argv))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    profile = None
    if args.profile_loop:
        import cProfile

        profile = cProfile.Profile()
    run = (lambda: profile.runcall(server.run, sockets=[sock])) if profile else (lambda: server.run(sockets=[sock]))
    loop_thread = threading.Thread(target=run, daemon=True, name="uvicorn")
    loop_thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    http_load.wait_healthy(url, "/health", timeout=600)
    loaded = engine.loaded
    print(json.dumps({"url": url + "/v1"}), flush=True)

    def engine_thread():
        return next(t for t in threading.enumerate() if t.name == "lockstep-engine")

    def counters() -> dict:
        return {"engine": thread_cpu(engine_thread()), "loop": thread_cpu(loop_thread),
                "process": time.process_time(), "wall": time.perf_counter()}

    def engine_only(streams: int, tokens: int, extra: dict) -> int:
        """`streams` requests straight to the engine (this thread's own event loop)."""
        from lockstep.server.engine.decoding.request_state import GenerationRequest
        from lockstep.server.engine.decoding.sampling import SamplingParams
        from lockstep.server.engine.guarantee.decode_plan import plan_request

        deployment = engine.deployment
        plan = plan_request(deployment, deterministic=bool(extra.get("deterministic")), speculative=None,
                            num_draft_tokens=None)
        requests = []
        for i in range(streams):
            messages = [{"role": "user", "content": http_load.prompt_for(i)}]
            prompt = list(loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
            sampling = SamplingParams(temperature=extra.get("temperature", 0.0), seed=extra.get("seed", i))
            requests.append(GenerationRequest(prompt_tokens=prompt, max_tokens=tokens, sampling=sampling))

        return asyncio.run(drive(engine, requests, [plan] * len(requests)))

    for line in sys.stdin:
        command = json.loads(line)
        if command["do"] == "counters":
            print(json.dumps(counters()), flush=True)
        elif command["do"] == "engine":
            before = counters()
            produced = engine_only(command["streams"], command["tokens"], command["extra"])
            print(json.dumps({"before": before, "after": counters(), "tokens": produced}), flush=True)
        elif command["do"] == "stop":
            break
    server.should_exit = True
    loop_thread.join(timeout=30)
    engine.stop()
    if profile is not None:
        import pstats

        with open(args.profile_loop, "w") as out:
            pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(40)


# ------------------------------------------------------------------------------ load side

def tiny_model_dir(out: Path) -> Path:
    """tests/synthetic.py's chat model (Qwen2.5's template, a byte-level tokenizer) at hidden 128,
    4 heads of 32 (a head size the pool's kernel takes), 2 layers."""
    sys.path.insert(0, str(ROOT / "tests"))
    from synthetic import CHAT_FAMILIES, llama_config, random_llama, write_chat_tokenizer, write_model_dir

    spec = CHAT_FAMILIES["qwen2.5"]
    vocab = write_chat_tokenizer(out, "qwen2.5")
    config = llama_config(hidden=128, intermediate=256, heads=4, kv_heads=2, layers=2, vocab=len(vocab))
    config["bos_token_id"], config["eos_token_id"] = None, vocab[spec["eos"]]
    write_model_dir(random_llama(config), config, out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [vocab[t] for t in spec["eos_tokens"]]}))
    return out


class Server:
    def __init__(self, name: str, tree: Path, args, model_dir: Path):
        self.name = name
        env = dict(os.environ)
        if tree.resolve() != ROOT:  # the tree's own lockstep namespace, ahead of the editable install
            ns = Path(tempfile.mkdtemp(prefix=f"host_share_{name}_"))
            (ns / "lockstep").mkdir()
            for part in ("server", "kernels", "models"):
                (ns / "lockstep" / part).symlink_to(tree.resolve() / part)
            env["PYTHONPATH"] = os.pathsep.join([str(ns), env.get("PYTHONPATH", "")])
        cmd = [sys.executable, str(Path(__file__).resolve()), "--serve-child", "--model", str(model_dir),
               "--limit", str(args.limit), "--max-streams", str(max(args.streams))]
        cmd += ["--gpu-path"] if args.gpu_path else []
        cmd += ["--profile-loop", f"{args.profile_loop}.{name}"] if args.profile_loop else []
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.url = self._read()["url"]

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"server {self.name} exited with {self.proc.wait()}")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, command: dict) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def stop(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"do": "stop"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


def one_round(server: Server, streams: int, tokens: int, extra, engine_only: bool) -> dict:
    if engine_only:
        sample = extra(0)
        r = server.ask({"do": "engine", "streams": streams, "tokens": tokens,
                        "extra": {k: v for k, v in sample.items() if k != "seed"}})
        before, after, produced, itl = r["before"], r["after"], r["tokens"], float("nan")
    else:
        before = server.ask({"do": "counters"})
        result = http_load.run_round(server.url, "default", streams, tokens, extra)
        after = server.ask({"do": "counters"})
        produced = result.tokens
        itl = http_load._percentile(result.itl_s, .5) * 1e3
        if result.errors:
            failed = http_load.stream_chat(server.url, "default", http_load.prompt_for(0), tokens, extra(0))
            raise RuntimeError(f"{result.errors} of {streams} streams failed on {server.name}: {failed.error}")
    wall = after["wall"] - before["wall"]
    per = {key: (after[key] - before[key]) * 1e6 / produced for key in ("engine", "loop", "process")}
    return {"tok/s": produced / wall, "ms/token/stream": itl, "tokens": produced,
            "engine µs/tok": per["engine"], "loop µs/tok": per["loop"],
            "other µs/tok": per["process"] - per["engine"] - per["loop"], "process µs/tok": per["process"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--max-streams", type=int, default=32, help=argparse.SUPPRESS)
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                        help="a variant: a source tree (default: this one, as 'this')")
    parser.add_argument("--limit", type=int, default=0, help="serve -L")
    parser.add_argument("--deterministic", action="store_true", help="requests send deterministic: true")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="> 0: seeded sampling (client i sends seed i)")
    parser.add_argument("--streams", default="1,16,32")
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens a request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpu-path", action="store_true",
                        help="the GPU's decode path: the KV pool's kernel (tests/doubles/pool_kernel.py's CPU "
                             "stand-in), so passes run compiled and are decoded ahead")
    parser.add_argument("--profile-loop", default=None, metavar="FILE",
                        help="the event loop's thread under cProfile, its top functions to FILE.<variant> at exit")
    parser.add_argument("--engine-only", action="store_true", help="submit to the engine in process, no HTTP")
    args = parser.parse_args()
    if args.serve_child:
        return serve_child(args)
    args.streams = [int(s) for s in args.streams.split(",")]
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1])) for t in args.tree] or [("this", ROOT)]

    def extra(i: int) -> dict:
        fields = {"temperature": args.temperature, "seed": i}
        return {**fields, "deterministic": True} if args.deterministic else fields

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model_dir(Path(tmp) / "tiny")
        servers = [Server(name, tree, args, model_dir) for name, tree in trees]
        try:
            print(f"host_share: tiny llama (hidden 128, 2 layers), L = {args.limit}, "
                  f"{'GPU path (pool kernel stand-in, compiled, decode ahead)' if args.gpu_path else 'serve defaults'}, "
                  f"{'deterministic' if args.deterministic else 'plain'} requests, temperature {args.temperature}, "
                  f"{args.tokens} tokens a stream, {'engine only (no HTTP)' if args.engine_only else 'HTTP'}, "
                  f"median of {args.rounds} rounds after one unmeasured round each, variants alternating")
            print(f"| variant | streams | tok/s | ms/token/stream | engine µs/tok | loop µs/tok | other µs/tok "
                  f"| process µs/tok |")
            print("|---|---|---|---|---|---|---|---|")
            for streams in args.streams:
                for server in servers:
                    one_round(server, streams, args.tokens, extra, args.engine_only)
                rounds = {server.name: [] for server in servers}
                for r in range(args.rounds):
                    order = servers[r % len(servers):] + servers[:r % len(servers)]
                    for server in order:
                        rounds[server.name].append(one_round(server, streams, args.tokens, extra, args.engine_only))
                for server in servers:
                    keys = rounds[server.name][0].keys()
                    med = {k: statistics.median(x[k] for x in rounds[server.name]) for k in keys}
                    print(f"| {server.name} | {streams} | {med['tok/s']:.0f} | {med['ms/token/stream']:.2f} "
                          f"| {med['engine µs/tok']:.0f} | {med['loop µs/tok']:.0f} | {med['other µs/tok']:.0f} "
                          f"| {med['process µs/tok']:.0f} |", flush=True)
        finally:
            for server in servers:
                server.stop()


if __name__ == "__main__":
    main()
