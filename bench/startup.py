"""Seconds from `lockstep serve` to a healthy /health: a first start vs a restart.

    .venv/bin/python bench/startup.py [--out FILE] [--only nvfp4|embedded]

Each case starts a real server process twice with the same, initially empty, verdict
cache (`LOCKSTEP_VERDICT_CACHE_DIR` in a temporary directory; the model import cache is the
user's, as for any start): the first start runs the kernel audit and the self-test, the
restart re-uses their verdicts. The startup phases come from /v1/models.

Cases (issue 10's goals):
- nvfp4: a 2-layer llama, hidden 1040 (16 mod 32), vocab 49152, float16, tied head,
  quantized to nvfp4 on disk (built here once, random weights);
- embedded: the embedded model with `--batch-invariant-limit 8 --draft-model default-quantized`.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build_nvfp4_1040(out: Path) -> Path:
    """2 layers, hidden 1040, vocab 49152, float16, tied embeddings, nvfp4 on disk."""
    if (out / "config.json").is_file():
        return out
    import mlx.core as mx
    from mlx_lm.utils import quantize_model

    from tests.synthetic import llama_config, random_llama, write_model_dir, write_tiny_tokenizer

    config = llama_config(vocab=49152)
    model = random_llama(config)
    model.set_dtype(mx.float16)
    model, config = quantize_model(model, config, None, None, mode="nvfp4")
    write_model_dir(model, config, out)
    write_tiny_tokenizer(out, vocab=49152)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_to_healthy(args: list[str], env: dict, log: Path, timeout: float = 1200) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    with open(log, "a") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lockstep.server.cli", "serve", "--port", str(port), *args],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited with {proc.returncode}; see {log}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"not healthy after {timeout}s; see {log}")
            time.sleep(0.1)
        healthy = time.perf_counter() - t0
        with urllib.request.urlopen(base + "/v1/models", timeout=10) as r:
            info = json.load(r)["data"][0]["lockstep"]
        return {"healthy_s": healthy, "startup": info.get("startup"),
                "audit": {k: info["audit"].get(k) for k in ("mode", "configurations", "cached",
                                                            "workarounds", "seconds")},
                "invariance": info.get("batch_invariance", {}).get("strategy")}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("nvfp4", "embedded"), default=None)
    parser.add_argument("--model-dir", default=None, help="where to build/keep the nvfp4 model")
    parser.add_argument("--out", default=None)
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="extra `lockstep serve` argument (repeat), e.g. --serve-arg=--weights=float16")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="lockstep-startup-"))
    model_dir = Path(args.model_dir) if args.model_dir else work / "nvfp4-1040"
    cases = {
        "nvfp4": lambda: ["--model", str(build_nvfp4_1040(model_dir))],
        "embedded": lambda: ["--batch-invariant-limit", "8", "--draft-model", "default-quantized"],
    }
    lines = []
    for name, make_args in cases.items():
        if args.only and name != args.only:
            continue
        serve_args = make_args() + args.serve_arg
        env = {**os.environ, "LOCKSTEP_VERDICT_CACHE_DIR": str(work / f"cache-{name}"),
               "LOCKSTEP_API_KEYS": ""}
        for start in ("first start", "restart"):
            r = start_to_healthy(serve_args, env, work / f"{name}.log")
            line = (f"{name:8s} {start:11s} healthy in {r['healthy_s']:6.1f} s; phases "
                    f"{json.dumps(r['startup'])}; audit {json.dumps(r['audit'])}; "
                    f"strategy {r['invariance']}")
            print(line, flush=True)
            lines.append(line)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
