"""How long `lockstep serve` takes to serve, and to prove its guarantee: a fresh start vs a restart.

On this machine (CPU), from the project root:

    .venv/bin/python bench/startup.py [--only embedded] [--only nvfp4] [--restarts 3] [--out FILE]

On the GPU machine (a source tree at /tmp/src, bench/README.md's "On the lent H200"), from /tmp/src:

    PYTHONPATH=/tmp/site:/tmp/ns:/tmp/src python3 bench/startup.py --only h200-float16 \\
        --only h200-nvfp4 --only h200-float16-l16 --out /tmp/startup.md   # then copy it to $OUT

Each start is a real server process (`python -m lockstep.server.cli serve`, with this
interpreter and environment). Measured from the moment the process is spawned:
- health: the first 200 from /health, and the CPU seconds the server process had used by then
  (Linux /proc; its own and its re-exec's, not its children's): on a machine other work
  shares, the wall time stretches with the load and the CPU seconds much less;
- first plain answer: one plain chat request, sent as soon as /health answers;
- guarantee: when /health's "guarantee" leaves "proving", and the state it settles in
  (a server without that key is taken as "in_force" once /health answers);
- the startup phases from /v1/models once the guarantee is settled (the largest are shown).

A fresh start gets empty caches: the verdict cache (`LOCKSTEP_VERDICT_CACHE_DIR`) and MLX's
CUDA compile caches (`MLX_PTX_CACHE_DIR`, `CUDA_CACHE_PATH`; set on every backend, used only
on CUDA), each a new temporary directory; the restarts re-use the same directories. The model
import cache is the user's, as for any start. Each start's server output goes to a log file
(its `startup:` lines are printed); a start that is not done within --timeout is killed and
reported as timed out.

Cases (`--only`, repeatable; default embedded and nvfp4):
- embedded: the embedded model, `--batch-invariant-limit 8 --draft-model default-quantized`;
- nvfp4: a 2-layer llama, hidden 1040 (16 mod 32), vocab 49152, float16, tied head,
  quantized to nvfp4 on disk, the embedded model's tokenizer (bench/model_dirs.py: built once,
  random weights);
- h200-float16: the embedded model in float16, L = 8, the quantized draft model;
- h200-nvfp4: the embedded model quantized to nvfp4 at load time, L = 8;
- h200-float16-l16: the embedded model in float16, L = 16;
- 8b-bf16, 8b-nvfp4 (issue 51): an 8B-shaped llama (32 layers, hidden 4096, MLP 14336, 32/8
  heads of 128; bench/model_dirs.py) with random weights and the embedded model's
  tokenizer (so its vocab, 49152: every token id the model can emit decodes), written once into
  an mlx-lm directory under --8b-models (16 GB for bf16; built in a child process), served by
  `lockstep serve --batch-invariant-limit 8 --cpu-blas reference`, each start followed by one of
  `mlx_lm.server` on the same directory with caches of its own (fresh, then restarts: the two
  alternate). `--small`: 2 layers, hidden 1024, MLP 2048 (a check on the CPU).
The h200 and 8b cases pass `--cpu-blas reference`, as docs/DESIGN.md asks for device runs.

`--server-log-level DEBUG`: lockstep logs each engine step of 0.1 s or more with what it ran, and the
turns served between proof steps (a first answer's wait on a fresh start, in each start's log).

A restart after a start stopped mid-proof: bench/startup_interrupted.py.

    PYTHONPATH=/tmp/site:/tmp/ns:/tmp/src python3 bench/startup.py --only 8b-nvfp4 --only 8b-bf16 \\
        --8b-models /tmp/models --out /tmp/startup_8b.md        # on the H200
    .venv/bin/python bench/startup.py --only 8b-nvfp4 --small      # the check here
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import table as markdown_table  # noqa: E402
from model_dirs import build_8b, build_nvfp4_1040  # noqa: E402

STOP_GRACE_S = 60       # after SIGTERM, before SIGKILL
POLL_S = 0.05           # /health polling interval
PLAIN_REQUEST = {"model": "default", "messages": [{"role": "user", "content": "Say hi"}],
                 "max_tokens": 8}


# ---------------------------------------------------------------- cases

EIGHT_B_ARGS = ["--batch-invariant-limit", "8", "--cpu-blas", "reference"]


def case_args(name: str, model_dir: Path, small: bool = False) -> list[str]:
    """`lockstep serve` arguments of one case (the nvfp4 and 8b cases build their model first)."""
    if name == "nvfp4":
        return ["--model", str(build_nvfp4_1040(model_dir))]
    if name.startswith("8b-"):
        weights = name.split("-", 1)[1]
        built = build_8b(model_dir / f"{name}{'-small' if small else ''}", weights, small)
        return ["--model", str(built), *EIGHT_B_ARGS]
    return CASES[name]


CASES = {
    "embedded": ["--batch-invariant-limit", "8", "--draft-model", "default-quantized"],
    "nvfp4": None,  # built on demand: case_args()
    "h200-float16": ["--weights", "float16", "--batch-invariant-limit", "8",
                     "--draft-model", "default-quantized", "--cpu-blas", "reference"],
    "h200-nvfp4": ["--quantize", "nvfp4", "--batch-invariant-limit", "8", "--cpu-blas", "reference"],
    "h200-float16-l16": ["--weights", "float16", "--batch-invariant-limit", "16",
                         "--cpu-blas", "reference"],
    "8b-bf16": None,  # built on demand: case_args()
    "8b-nvfp4": None,
}
DEFAULT_CASES = ("embedded", "nvfp4")


def cache_env(cache_root: Path) -> dict:
    """The environment of a case's starts: its own (initially empty) verdict and compile caches."""
    dirs = {"LOCKSTEP_VERDICT_CACHE_DIR": "verdicts", "MLX_PTX_CACHE_DIR": "ptx",
            "CUDA_CACHE_PATH": "cuda"}
    for sub in dirs.values():
        (cache_root / sub).mkdir(parents=True, exist_ok=True)
    return {**os.environ, "LOCKSTEP_API_KEYS": "",
            **{var: str(cache_root / sub) for var, sub in dirs.items()}}


# ---------------------------------------------------------------- one start

@dataclass
class Start:
    label: str
    log: Path
    health_s: float | None = None
    health_cpu_s: float | None = None  # the server process's CPU seconds at its first /health 200
    first_plain_s: float | None = None
    plain_error: str | None = None
    guarantee_s: float | None = None
    state: str | None = None
    reports_guarantee: bool = True   # False: an older server without /health's "guarantee"
    phases: dict = field(default_factory=dict)
    models_state: str | None = None  # /v1/models' batch_invariance.state, if any
    failure: str | None = None       # "timed out ..." / "exited with ..."


class StartFailed(Exception):
    pass


class PlainRequest(threading.Thread):
    """One plain chat request, timed from `t0` (the spawn) to its answer."""

    def __init__(self, base: str, t0: float, timeout: float, model: str = "default"):
        super().__init__(daemon=True)  # never keeps the bench alive
        self.base, self.t0, self.timeout, self.model = base, t0, timeout, model
        self.seconds: float | None = None
        self.error: str | None = None

    def request(self) -> dict:
        return {**PLAIN_REQUEST, "model": self.model}

    def answered(self, body: dict) -> None:
        """What a subclass reads from the answer besides its time."""

    def run(self) -> None:
        req = urllib.request.Request(self.base + "/v1/chat/completions", data=json.dumps(self.request()).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                body = json.load(r)
            body["choices"][0]["message"]  # an answer, not just a 200
            self.seconds = time.perf_counter() - self.t0
            self.answered(body)
        except Exception as exc:  # noqa: BLE001 -- reported in the table
            self.error = f"{type(exc).__name__}: {exc}"[:120]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MLX_LM = "mlx_lm.server"  # server arguments starting with this start mlx-lm's server instead
LOG_LEVEL = ["--log-level", "INFO"]  # lockstep's (`--server-log-level DEBUG`: each slow engine step logged)
LOG_DIR = [None]  # `--logs`: where each start's server log goes (None: the run's temporary directory)


def log_file(work: Path, name: str) -> Path:
    return (LOG_DIR[0] or work) / name


def spawn(serve_args: list[str], port: int, env: dict, log: Path) -> subprocess.Popen:
    """The server process, its output (stdout and stderr) in `log`, in its own process group."""
    if serve_args[:1] == [MLX_LM]:
        command = [sys.executable, "-m", MLX_LM, "--port", str(port), *serve_args[1:]]
    else:
        command = [sys.executable, "-m", "lockstep.server.cli", *LOG_LEVEL, "serve", "--port", str(port), *serve_args]
    with open(log, "w") as out:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def launch(serve_args: list[str], env: dict, log: Path, timeout: float):
    """A server spawned on a free port: (process, base URL, spawn time, deadline)."""
    port = free_port()
    t0 = time.perf_counter()
    return spawn(serve_args, port, env, log), f"http://127.0.0.1:{port}", t0, t0 + timeout


def stop(proc: subprocess.Popen) -> str | None:
    """SIGTERM and wait; SIGKILL (its process group) after STOP_GRACE_S. Returns a note if killed."""
    if proc.poll() is not None:
        return None
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_GRACE_S)
        return None
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return f"SIGKILLed {STOP_GRACE_S} s after SIGTERM"


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process `pid` has used (its children not counted), or None
    where /proc does not say."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def get_json(url: str, timeout: float) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        if r.status != 200:
            raise OSError(f"HTTP {r.status}")
        return json.load(r)


def check_alive(proc: subprocess.Popen, deadline: float, waiting_for: str) -> None:
    if proc.poll() is not None:
        raise StartFailed(f"exited with {proc.returncode} waiting for {waiting_for}")
    if time.perf_counter() > deadline:
        raise StartFailed(f"timed out waiting for {waiting_for}")


def poll_health(base: str) -> dict | None:
    """/health's body, or None while it does not answer 200 (not listening yet, 503, a slow
    answer). Any other HTTP error is a broken server: StartFailed."""
    try:
        return get_json(base + "/health", timeout=2)
    except urllib.error.HTTPError as exc:
        if exc.code >= 500 and exc.code != 503:
            raise StartFailed(f"/health answered HTTP {exc.code}") from exc
    except (OSError, ValueError):
        pass
    return None


def wait_for_health(base: str, proc: subprocess.Popen, deadline: float) -> dict:
    """Polls /health until its first 200; returns the body."""
    while True:
        check_alive(proc, deadline, "/health")
        health = poll_health(base)
        if health is not None:
            return health
        time.sleep(POLL_S)


def wait_for_guarantee(base: str, proc: subprocess.Popen, deadline: float, health: dict) -> dict:
    """Polls /health until its guarantee leaves "proving"; returns that body."""
    while health.get("guarantee", "in_force") == "proving":
        check_alive(proc, deadline, "the guarantee")
        time.sleep(POLL_S)
        health = poll_health(base) or health
    return health


def model_details(base: str) -> tuple[dict, str | None]:
    """(startup phases, batch_invariance.state) from /v1/models (details under "lockstep" or not)."""
    card = get_json(base + "/v1/models", timeout=30)["data"][0]
    info = card.get("lockstep") or card
    phases = (info.get("startup") or {}).get("phases_s") or {}
    return phases, (info.get("batch_invariance") or {}).get("state")


def measure_start(label: str, serve_args: list[str], env: dict, log: Path, timeout: float) -> Start:
    """One server start, timed from its spawn; the server is stopped before this returns."""
    result = Start(label, log)
    proc, base, t0, deadline = launch(serve_args, env, log, timeout)
    plain = None
    try:
        health = wait_for_health(base, proc, deadline)
        result.health_s = time.perf_counter() - t0
        result.health_cpu_s = cpu_seconds(proc.pid)
        plain = PlainRequest(base, t0, timeout=max(1.0, deadline - time.perf_counter()),
                             model="default_model" if serve_args[:1] == [MLX_LM] else "default")
        plain.start()
        result.reports_guarantee = "guarantee" in health
        settled = wait_for_guarantee(base, proc, deadline, health)
        result.guarantee_s = (time.perf_counter() - t0 if result.reports_guarantee
                              else result.health_s)
        result.state = settled.get("guarantee", "in_force")
        plain.join(timeout=max(0.0, deadline - time.perf_counter()))
        if plain.is_alive():
            raise StartFailed("timed out waiting for the plain answer")
        if serve_args[:1] != [MLX_LM]:  # lockstep's startup details; mlx-lm's server has none
            result.phases, result.models_state = model_details(base)
    except StartFailed as exc:
        result.failure = str(exc)
    except (OSError, ValueError, KeyError, IndexError) as exc:
        result.failure = f"/v1/models: {type(exc).__name__}: {exc}"
    finally:
        killed = stop(proc)
        if killed:
            result.failure = "; ".join(filter(None, (result.failure, killed)))
    if plain is not None and not plain.is_alive():
        result.first_plain_s, result.plain_error = plain.seconds, plain.error
    if result.reports_guarantee and result.guarantee_s is None and result.health_s is not None:
        result.state = "proving"  # never left it
    return result


def startup_lines(log: Path) -> list[str]:
    try:
        return [line.rstrip() for line in log.read_text(errors="replace").splitlines()
                if "startup:" in line]
    except OSError:
        return []


# ---------------------------------------------------------------- a case

def median_start(starts: list[Start], prefix: str = "", what: str = "restart") -> Start:
    """The median of each measurement (and phase) over `starts`; states joined if they differ."""
    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    keys = {k for s in starts for k in s.phases}
    states = sorted({s.state for s in starts if s.state})
    failures = [s.failure for s in starts if s.failure]
    return Start(
        f"{prefix}{what} (median of {len(starts)})", starts[0].log,
        health_s=med(s.health_s for s in starts),
        health_cpu_s=med(s.health_cpu_s for s in starts),
        first_plain_s=med(s.first_plain_s for s in starts),
        guarantee_s=med(s.guarantee_s for s in starts),
        state="/".join(states) or None,
        reports_guarantee=all(s.reports_guarantee for s in starts),
        phases={k: med(s.phases.get(k) for s in starts) for k in keys},
        failure=f"{len(failures)} of {len(starts)} failed" if failures else None)


def run_case(name: str, serve_args: list[str], work: Path, restarts: int, timeout: float,
             against: list[str] | None = None, rounds: int = 1) -> list[Start]:
    """`rounds` times: a fresh start (new, empty caches), then `restarts` restarts with the same
    caches, removed after. `against`: another server's arguments (mlx_lm.server's), started after
    each of these with caches of its own, so the two alternate. With several rounds or restarts,
    their medians are added."""
    labels = ["fresh"] + [f"restart {i}" if restarts > 1 else "restart" for i in range(1, restarts + 1)]
    prefixes = [""] + ([MLX_LM + " "] if against else [])
    fresh: dict[str, list[Start]] = {prefix: [] for prefix in prefixes}
    again: dict[str, list[Start]] = {prefix: [] for prefix in prefixes}
    for n in range(1, rounds + 1):
        tag = f"-{n}" if rounds > 1 else ""
        servers = [("", serve_args, work / f"cache-{name}{tag}")]
        if against:
            servers.append((MLX_LM + " ", against, work / f"cache-{name}-mlx-lm{tag}"))
        try:
            for label in labels:
                for prefix, args, cache_root in servers:
                    shown = f"{label} {n}" if rounds > 1 and label == "fresh" else label
                    log = log_file(work, f"{name}-{prefix.strip().replace('.', '-')}{label.replace(' ', '')}{tag}.log")
                    start = measure_start(prefix + shown, args, cache_env(cache_root), log, timeout)
                    print(f"{name} {prefix}{shown}: " + "; ".join(row(start)[1:]) + f"  (log {log})", flush=True)
                    for line in startup_lines(log):
                        print(f"    {line}", flush=True)
                    print(f"    phases from /v1/models: {json.dumps(start.phases)}", flush=True)
                    (fresh if label == "fresh" else again)[prefix].append(start)
                if label == "fresh" and fresh[""][-1].health_s is None:
                    print(f"{name}: the fresh start never answered /health; restarts skipped", flush=True)
                    break
        finally:
            for _, _, cache_root in servers:
                shutil.rmtree(cache_root, ignore_errors=True)
    rows = []
    for prefix in prefixes:
        rows += fresh[prefix]
        if rounds > 1:
            rows.append(median_start(fresh[prefix], prefix, "fresh"))
        rows += again[prefix]
        if len(again[prefix]) > 1:
            rows.append(median_start(again[prefix], prefix))
    return rows


# ---------------------------------------------------------------- the table

def seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f} s"


def largest_phases(phases: dict, n: int = 3) -> str:
    top = sorted(((v, k) for k, v in phases.items() if v is not None), reverse=True)[:n]
    return ", ".join(f"{k} {v:.1f}" for v, k in top) or "—"


def row(s: Start) -> list[str]:
    plain = seconds(s.first_plain_s) if s.plain_error is None else f"error ({s.plain_error})"
    state = s.state or "—"
    if not s.reports_guarantee:
        state += "*"
    if s.models_state and s.state and s.models_state != s.state:
        state += f"; /v1/models {s.models_state}"
    guarantee = f"{seconds(s.guarantee_s)} ({state})"
    health = seconds(s.health_s) + ("" if s.health_cpu_s is None else f" (cpu {s.health_cpu_s:.1f} s)")
    if s.failure:
        health += f" [{s.failure}]"
    return [s.label, health, plain, guarantee, largest_phases(s.phases)]


def table(name: str, serve_args: list[str], starts: list[Start], against: list[str] | None = None) -> str:
    header = ["start", "health", "first plain answer", "guarantee (state)", "largest phases (s)"]
    beside = f" and `python -m {' '.join(against)}`" if against else ""
    lines = [f"### {name}", "", f"`lockstep serve {' '.join(serve_args)}`{beside}", "",
             markdown_table(header, [row(s) for s in starts])]
    if not all(s.reports_guarantee for s in starts):
        lines += ["", "\\* this server's /health has no \"guarantee\": taken as in force at /health."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--only", action="append", choices=tuple(CASES), default=None,
                        help=f"case to run (repeat for several; default {' and '.join(DEFAULT_CASES)})")
    parser.add_argument("--rounds", type=int, default=1,
                        help="fresh starts, each with new caches and its restarts (more than 1: medians added)")
    parser.add_argument("--restarts", type=int, default=1,
                        help="restarts after the fresh start (more than 1: their median is added)")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds a start may take to settle its guarantee and answer (default 600)")
    parser.add_argument("--model-dir", default=None, help="where to build/keep the nvfp4 model")
    parser.add_argument("--out", default=None, help="also write the tables (markdown) here")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="extra `lockstep serve` argument (repeat), e.g. --serve-arg=--audit=fresh")
    parser.add_argument("--8b-models", dest="eight_b_models", default=None,
                        help="where to build/keep the 8b cases' models (default: a temporary directory)")
    parser.add_argument("--small", action="store_true",
                        help="the 8b cases at a small shape (2 layers, hidden 1024): a check on the CPU")
    parser.add_argument("--server-log-level", default="INFO",
                        help="lockstep's log level (DEBUG: each engine step of 0.1 s or more, with what it ran)")
    parser.add_argument("--no-mlx-lm", action="store_true", help="the 8b cases without mlx_lm.server beside them")
    parser.add_argument("--logs", default=None,
                        help="write each start's server log here (default: the run's temporary directory), "
                             "e.g. under $OUT on the lent GPU, so the logs come back")
    args = parser.parse_args()
    LOG_LEVEL[1] = args.server_log_level
    if args.logs:
        LOG_DIR[0] = Path(args.logs)
        LOG_DIR[0].mkdir(parents=True, exist_ok=True)
    if args.restarts < 1 or args.rounds < 1:
        parser.error("--restarts and --rounds must be at least 1")

    work = Path(tempfile.mkdtemp(prefix="lockstep-startup-"))
    model_dir = Path(args.model_dir) if args.model_dir else work / "nvfp4-1040"
    print(f"logs in {LOG_DIR[0] or work}", flush=True)
    tables = []
    for name in args.only or DEFAULT_CASES:
        serve_args = case_args(name, Path(args.eight_b_models or work) if name.startswith("8b-") else model_dir,
                               args.small)
        serve_args += args.serve_arg
        against = ([MLX_LM, "--model", serve_args[serve_args.index("--model") + 1]]
                   if name.startswith("8b-") and not args.no_mlx_lm else None)
        starts = run_case(name, serve_args, work, args.restarts, args.timeout, against, args.rounds)
        tables.append(table(name, serve_args, starts, against))
        print("\n" + tables[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
