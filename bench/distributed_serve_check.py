"""A distributed `lockstep serve` end to end on one multi-GPU host (issue 14, CUDA/NCCL).

Starts `lockstep serve --parallel MODE` under MLX's launcher, waits for /health, asks the
same deterministic greedy questions alone and then all at once (batched), compares the
answers, then SIGKILLs the last rank's process and times how long rank 0 takes to exit.
Prints a short report; asserts nothing (tests/test_distributed.py does, on the CPU).

    python bench/distributed_serve_check.py --backend nccl -n 2 --parallel pipeline -- --weights float16
"""
import argparse
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Name three colors.", "What is 2+2?", "Say hi to me.", "Count to five.", "Name a river."]


def post(base: str, prompt: str) -> str:
    body = {"model": "default", "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": 32, "deterministic": True}
    request = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def healthy(base: str) -> bool:
    try:
        return urllib.request.urlopen(base + "/health", timeout=2).status == 200
    except OSError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="nccl")
    parser.add_argument("-n", type=int, default=2)
    parser.add_argument("--parallel", default="pipeline")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("serve_args", nargs="*")
    args = parser.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    launch = ("import sys; from mlx._distributed_utils.launch import main; sys.argv=['mlx.launch','--backend',"
              f"'{args.backend}','-n','{args.n}','--verbose','--python','{sys.executable}','{ROOT}/server/cli.py',"
              f"'serve','--parallel','{args.parallel}','--port','{args.port}','--batch-invariant-limit','8',"
              + "".join(f"'{a}'," for a in args.serve_args) + "]; main()")
    log = open("/tmp/distributed_serve.log", "w")
    launcher = subprocess.Popen([sys.executable, "-c", launch], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    start = time.monotonic()
    while not healthy(base):
        if launcher.poll() is not None or time.monotonic() - start > 400:
            print("did not start:\n" + Path("/tmp/distributed_serve.log").read_text()[-3000:])
            return 1
        time.sleep(0.5)
    print(f"{args.parallel} over {args.n} ranks ({args.backend}): healthy after {time.monotonic() - start:.1f} s")
    models = json.loads(urllib.request.urlopen(base + "/v1/models").read())["data"][0]["lockstep"]
    print("topology:", json.dumps(models.get("distributed")), "strategy:", models.get("invariance", {}).get("strategy"))
    alone = [post(base, q) for q in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        batched = list(pool.map(lambda q: post(base, q), PROMPTS))
    again = [post(base, q) for q in PROMPTS]
    print(f"deterministic answers: batched == alone {sum(a == b for a, b in zip(alone, batched))}/{len(PROMPTS)}, "
          f"rerun == alone {sum(a == b for a, b in zip(alone, again))}/{len(PROMPTS)}")
    print("sample:", json.dumps(alone[0]))
    ranks = subprocess.run(["pgrep", "-f", "cli.py serve --parallel"], capture_output=True, text=True).stdout.split()
    pids = sorted(int(p) for p in ranks if int(p) != os.getpid())
    victim = pids[-1]
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    while any(Path(f"/proc/{p}").exists() and "zombie" not in Path(f"/proc/{p}/status").read_text().lower()
              for p in pids if p != victim) and time.monotonic() - killed < 60:
        time.sleep(0.2)
    print(f"killed pid {victim}; every other rank gone after {time.monotonic() - killed:.1f} s "
          f"(health now: {healthy(base)})")
    os.killpg(launcher.pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
