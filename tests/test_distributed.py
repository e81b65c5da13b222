"""Distributed serving (issue 14) on the CPU: ring backend on localhost, the embedded model,
driven through the official `openai` client against rank 0.

Each rank is started as `mlx.launch --backend ring` starts a local rank (MLX_RANK plus an
MLX_HOSTFILE listing every rank's address), directly, so the test knows every rank's pid
and exit code (mlx.launch itself exits 0 whatever its ranks do). Each deployment is started
once and several checks run against it; the whole file takes a few minutes on 2 cores.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx
import pytest
from openai import OpenAI

from lockstep.server.distributed.pipeline import layer_split
from lockstep.server.distributed.sharding import pipeline_problem, tensor_parallel_problem
from lockstep.server.distributed.world import DistributedStartupError, join
from lockstep.server.fingerprint import system_fingerprint
from tests.deterministic_fixtures import float_bits
from tests.http_server import free_port, wait_until

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Name three colors.", "What is 2+2?", "Say hi to me.", "Count to five."]
EXIT_WITHIN_S = 30.0


class RingDeployment:
    """`lockstep serve --parallel MODE` over N local ranks; rank 0 on a free HTTP port."""

    def __init__(self, tmp: Path, parallel: str, ranks: int, *extra: str, port: int | None = None):
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        tmp.mkdir(parents=True, exist_ok=True)
        hostfile = tmp / "hostfile.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(ranks)]))
        command = [sys.executable, "-m", "lockstep.server.cli", "serve", "--parallel", parallel,
                   "--port", str(self.port), "--batch-invariant-limit", "2", "--max-active", "4",
                   "--max-batch-rows", "4",  # every rank proves every pass width: keep them few
                   "--connect-timeout", "60", "--rank-timeout", "15", *extra]
        self.logs = [tmp / f"rank{r}.log" for r in range(ranks)]
        self.procs = []
        for rank in range(ranks):
            env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
            with open(self.logs[rank], "w") as log:
                self.procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=log,
                                                   stderr=subprocess.STDOUT))

    def log(self, rank: int = 0) -> str:
        return self.logs[rank].read_text()[-4000:]

    def wait_healthy(self, timeout: float = 400.0) -> None:
        def up():
            for rank, proc in enumerate(self.procs):
                assert proc.poll() is None, f"rank {rank} exited {proc.returncode}:\n{self.log(rank)}"
            try:
                return httpx.get(self.base + "/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, timeout=timeout, what="the distributed deployment to start")

    def wait_exited(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in self.procs]

    def stop(self) -> None:
        for proc in self.procs:  # only our own ranks, by pid
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# MLX's ring backend stops trying to reach the next rank after about 30 s ("Couldn't connect
# (error: 111)"); on a loaded 2-core machine three ranks can take longer than that to start
# (imports, the BLAS re-exec). That is the launch environment, not the deployment: its own
# refusal of a missing peer is test_missing_peer_ends_with_a_clear_error_not_a_hang. So a
# deployment whose rank gave up connecting is started once more, on fresh ports.
RING_CONNECT_GAVE_UP = "Couldn't connect (error: 111)"


def _running(tmp: Path, parallel: str, ranks: int):
    for attempt in range(2):
        deployment = RingDeployment(tmp / f"attempt{attempt}", parallel, ranks)
        try:
            deployment.wait_healthy()
            break
        except AssertionError:
            deployment.stop()
            if attempt or not any(RING_CONNECT_GAVE_UP in deployment.log(r) for r in range(ranks)):
                raise
    try:
        yield deployment
    finally:
        deployment.stop()


@pytest.fixture(scope="module")
def pipeline2(tmp_path_factory):
    yield from _running(tmp_path_factory.mktemp("pipeline2"), "pipeline", 2)


@pytest.fixture(scope="module")
def tensor3(tmp_path_factory):
    yield from _running(tmp_path_factory.mktemp("tensor3"), "tensor", 3)


@dataclass(frozen=True)
class Answer:
    text: str
    tokens: tuple  # each generated token's id (`return_token_ids`)
    logprobs: tuple  # IEEE-754 bits of each token's logprob and of its top alternatives'
    fingerprint: str
    lockstep: dict

    def bits(self) -> tuple:
        """What two answers to one deterministic request must share, bit for bit."""
        return self.text, self.tokens, self.logprobs


def ask(base: str, prompt: str, *, seed: int = 7, deterministic: bool = True, max_tokens: int = 6) -> Answer:
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0.8, seed=seed, logprobs=True, top_logprobs=2,
        extra_body={"deterministic": deterministic, "return_token_ids": True})
    choice = reply.choices[0]
    content = choice.logprobs.content
    return Answer(choice.message.content, tuple(choice.model_extra["lockstep"]["token_ids"]),
                  tuple((float_bits(t.logprob), tuple(float_bits(a.logprob) for a in t.top_logprobs))
                        for t in content),
                  reply.system_fingerprint, reply.model_extra.get("lockstep"))


def alone_then_together(base: str, **options) -> tuple[Answer, list[Answer]]:
    """PROMPTS[0] alone, then every prompt at once (they share passes)."""
    alone = ask(base, PROMPTS[0], **options)
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: ask(base, p, **options), PROMPTS))
    return alone, together


def shared_passes(base: str) -> dict[str, float]:
    """Decode and prefill passes so far that more than one request shared (rank 0's metrics)."""
    lines = httpx.get(base + "/metrics").text.splitlines()

    def value(prefix: str) -> float:
        return next(float(line.split()[-1]) for line in lines if line.startswith(prefix))

    return {kind: value(f"{name}_count") - value(f'{name}_bucket{{le="1.0"}}')
            for kind, name in (("decode", "lockstep_forward_pass_requests"),
                               ("prefill", "lockstep_prefill_pass_requests"))}


def check_deterministic(deployment: RingDeployment, parallel: str, ranks: int) -> str:
    base = deployment.base
    before = shared_passes(base)
    alone, together = alone_then_together(base)
    shared = {kind: count - before[kind] for kind, count in shared_passes(base).items()}
    again = ask(base, PROMPTS[0])
    assert together[0].bits() == alone.bits(), "the answer together differs from alone"
    assert again.bits() == alone.bits(), "a rerun changed the answer"
    assert all(a.text and a.tokens for a in together), "an empty answer"
    assert alone.lockstep["guaranteed"], alone.lockstep  # batch invariance proven on the shards
    assert len({b.text for b in together}) == len(PROMPTS), "distinct prompts gave one answer"
    fingerprints = {a.fingerprint for a in [alone, again, *together]}
    assert len(fingerprints) == 1
    models = httpx.get(base + "/v1/models").json()["data"][0]["lockstep"]
    assert models["distributed"] == {"world_size": ranks, "backend": "ring", "parallel": parallel}
    assert models["batch_invariance"]["guaranteed"]
    assert f"parallel={parallel}/{ranks}/ring" in models["transform"]
    # The requests sent together shared decode passes. Every pass runs on every rank with the
    # same shapes (its collectives need all of them), and every rank checks its output digest
    # against rank 0's at each boundary, failing the deployment on a mismatch: rank 0's count
    # is every rank's, and the deployment still answering shows they stayed in step.
    assert shared["decode"] >= 1, shared
    assert httpx.get(base + "/health").status_code == 200

    # Control: the same load without determinism. A plain request's decode rows go through
    # the BLAS in passes of one row alone and of several together; unless the self-test proved
    # this backend's rows the same in both ("native"), they are computed in another order there
    # (on OpenBLAS, the ranks' `--cpu-blas auto` here, passes wider than L), and the logprobs
    # change with the company: the checks above could fail.
    plain_alone, plain_together = alone_then_together(base, deterministic=False, max_tokens=3)
    assert plain_alone.lockstep["deterministic"] is False
    if models["batch_invariance"]["strategy"] == "native":  # rows never depend on the batch here
        assert plain_together[0].bits() == plain_alone.bits()
    else:
        assert plain_together[0].bits() != plain_alone.bits(), \
            "a plain request together gave the bits it gave alone: this control cannot fail the checks above"
    return fingerprints.pop()


# ------------------------------------------------------------------ checks without a deployment


def test_tensor_parallel_refuses_heads_that_do_not_divide(embedded_model):
    model = embedded_model.model  # 9 query heads, 3 KV heads, 30 layers
    assert tensor_parallel_problem(model, 3) is None
    problem = tensor_parallel_problem(model, 2)
    assert "query heads 9" in problem and "KV heads 3" in problem and "divide over 2" in problem
    assert "KV heads 3" in tensor_parallel_problem(model, 9)
    assert pipeline_problem(model, 2) is None
    assert "30 layers, fewer than the 31" in pipeline_problem(model, 31)


def test_layer_split_matches_mlx_lm():
    assert layer_split(30, 2) == [15, 15]
    assert layer_split(31, 3) == [11, 10, 10]
    with pytest.raises(ValueError, match="2 layers cannot be split over 3"):
        layer_split(2, 3)


def test_single_device_fingerprint_unchanged_and_topology_named(embedded_model):
    common = dict(transform="t", strategy="s", limit=2, blas="b", prefill_chunk=512)
    single = system_fingerprint(embedded_model.path, **common)
    assert single == system_fingerprint(embedded_model.path, topology=None, **common)
    tensor = system_fingerprint(embedded_model.path, topology="tensor/3/ring", **common)
    pipeline = system_fingerprint(embedded_model.path, topology="pipeline/2/ring", **common)
    assert len({single, tensor, pipeline}) == 3


def test_parallel_without_a_launcher_is_a_clear_error(monkeypatch):
    for name in ("MLX_RANK", "MLX_HOSTFILE", "NCCL_HOST_IP", "NCCL_PORT", "MLX_JACCL_COORDINATOR"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(DistributedStartupError, match="needs a distributed launch.*mlx.launch"):
        join("tensor")


def run_rank(env_extra: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra}
    return subprocess.run([sys.executable, "-m", "lockstep.server.cli", "serve", "--parallel", "pipeline", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_bad_hostfile_is_a_clear_startup_error(tmp_path):
    bad = tmp_path / "hostfile.json"
    bad.write_text("not json")
    result = run_rank({"MLX_RANK": "0", "MLX_HOSTFILE": str(bad)}, "--cpu-blas", "reference")
    assert result.returncode == 1
    assert "not a valid hostfile" in result.stderr


def test_missing_peer_ends_with_a_clear_error_not_a_hang(tmp_path):
    hostfile = tmp_path / "hostfile.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]))
    result = run_rank({"MLX_RANK": "0", "MLX_HOSTFILE": str(hostfile)}, "--cpu-blas", "reference",
                      "--connect-timeout", "3", timeout=100)  # a hang fails here (TimeoutExpired)
    assert result.returncode == 1
    assert "if they have not all joined within 3 s this rank exits 1" in result.stderr
    assert "Timeout" in result.stderr  # faulthandler's exit, not a hang


def test_busy_port_is_reported_by_every_rank(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        deployment = RingDeployment(tmp_path, "pipeline", 2, "--cpu-blas", "reference",
                                    port=taken.getsockname()[1])
        try:
            codes = deployment.wait_exited(180)
        finally:
            deployment.stop()
    assert codes == [1, 1]
    for rank in (0, 1):
        assert "rank 0: cannot listen on 127.0.0.1" in deployment.log(rank)


# ------------------------------------------------------------------ pipeline over 2 ranks


def test_pipeline_is_deterministic_alone_batched_and_rerun(pipeline2):
    check_deterministic(pipeline2, "pipeline", 2)


def test_pipeline_serves_plain_prompts_arriving_together(pipeline2):
    # Plain prompts admitted in one step share one prefill pass; every stage's hand-off must
    # be in what each rank evaluates, or the next stage waits for it forever. The prompts are
    # new to the server (a plain request resumes where a prefix-cache hit ends: one the other
    # tests asked would need no prefill).
    before = shared_passes(pipeline2.base)["prefill"]
    fresh = [f"Quickly, please: {p}" for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(fresh)) as pool:
        answers = list(pool.map(lambda p: ask(pipeline2.base, p, deterministic=False, max_tokens=2), fresh))
    assert all(a.text for a in answers), answers
    assert shared_passes(pipeline2.base)["prefill"] > before, "no prefill pass was shared"


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _segments(pids: list[int]) -> dict[int, int]:
    """TCP data segments each process has sent and received so far (its ring links to the other
    ranks, and rank 0's HTTP), from `ss`."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    counts, owner = dict.fromkeys(pids, 0), None
    for line in out.splitlines():
        if not line[:1].isspace():  # a socket line, its counters on the indented line below
            owner = next((pid for pid in pids if f"pid={pid}," in line), None)
        elif owner is not None:
            counts[owner] += sum(int(n) for n in re.findall(r"\bdata_segs_(?:in|out):(\d+)", line))
    return counts


def _idle(base: str) -> bool:
    health = httpx.get(base + "/health").json()
    return health["active"] == health["waiting"] == 0


# Idle ranks meet at a boundary every IDLE_TICK_S: a broadcast of a few segments per rank and a
# few milliseconds of CPU. A rank that waits for the next boundary inside the collective spins
# there instead, and pays the whole wait in CPU for each boundary's few segments.
IDLE_SEGMENTS = 100
CPU_PER_SEGMENT_S = 0.01


@pytest.mark.skipif(not Path("/proc/self/stat").exists() or shutil.which("ss") is None,
                    reason="reads /proc and `ss`")
def test_idle_ranks_sleep_instead_of_waiting_inside_a_collective(pipeline2):
    # Before: the non-root rank waited for rank 0's heartbeat inside the ring all_sum, a core busy.
    pids = [p.pid for p in pipeline2.procs]
    wait_until(lambda: _idle(pipeline2.base), what="the deployment to be idle")
    cpu, segments = [_cpu_seconds(pid) for pid in pids], _segments(pids)
    wait_until(lambda: all(n - segments[pid] >= IDLE_SEGMENTS for pid, n in _segments(pids).items()),
               timeout=300, what=f"every rank to exchange {IDLE_SEGMENTS} segments")
    now = _segments(pids)
    per_segment = [(_cpu_seconds(pid) - c) / (now[pid] - segments[pid]) for pid, c in zip(pids, cpu)]
    assert all(c < CPU_PER_SEGMENT_S for c in per_segment), \
        f"CPU seconds per TCP segment exchanged while idle, per rank: {per_segment}"
    assert ask(pipeline2.base, PROMPTS[1], deterministic=False).text  # and it still serves


def test_pipeline_rank_killed_midway_ends_the_deployment(pipeline2):
    """SIGKILL the worker while a request runs: the client gets an error or a dropped
    connection, /health stops answering 200, and every rank exits non-zero within 30 s."""
    client_errors = []

    def long_request():
        try:
            ask(pipeline2.base, "Write a long story about a dragon.")
        except Exception as exc:  # what the client sees is an error, not a hang
            client_errors.append(exc)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(long_request)
        wait_until(lambda: not _idle(pipeline2.base), what="the request to reach the engine")
        killed_at = time.monotonic()
        os.kill(pipeline2.procs[1].pid, signal.SIGKILL)
        codes = pipeline2.wait_exited(EXIT_WITHIN_S)
        took = time.monotonic() - killed_at
        future.result(timeout=60)
    assert codes[1] == -signal.SIGKILL
    assert codes[0] not in (None, 0), f"rank 0 did not exit non-zero within {EXIT_WITHIN_S} s: {codes}"
    assert took < EXIT_WITHIN_S
    assert "deployment failed" in pipeline2.log(0)
    with pytest.raises(httpx.TransportError):
        httpx.get(pipeline2.base + "/health")
    print(f"rank 0 exited {codes[0]} {took:.1f} s after the worker was killed")


# ------------------------------------------------------------------ tensor parallel over 3 ranks


def test_tensor_is_deterministic_alone_batched_and_rerun(tensor3):
    check_deterministic(tensor3, "tensor", 3)


def test_tensor_constrained_requests_reach_every_rank(tensor3):
    """A grammar travels to the other ranks (pickled as its source, recompiled there) and
    n = 2 choices share one prefill on every rank: the deployment stays in step."""
    client = OpenAI(base_url=tensor3.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Give me a JSON object."}], max_tokens=24,
        temperature=0, n=2, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False}}})
    assert len({c.message.content for c in reply.choices}) == 1  # greedy: both choices agree
    for c in reply.choices:
        assert isinstance(json.loads(c.message.content)["ok"], bool)
    assert httpx.get(tensor3.base + "/health").status_code == 200


def test_tensor_stops_cleanly_on_sigterm(tensor3):
    tensor3.procs[0].send_signal(signal.SIGTERM)
    codes = tensor3.wait_exited(EXIT_WITHIN_S)
    assert codes == [0, 0, 0], [tensor3.log(r) for r in range(3)]


def test_pipeline_handoffs_are_bit_identical_to_one_device():
    """Both hand-off forms (send/recv; all_sum where, as with MLX's NCCL, there is no send)."""
    launcher = Path(sys.executable).parent / "mlx.launch"
    result = subprocess.run([str(launcher), "--backend", "ring", "-n", "2", "--python", sys.executable,
                             str(ROOT / "tests" / "distributed_handoff_check.py")],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert "handoffs bit-identical to one device: True" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]
