"""`lockstep replay` without `--url` (server/tools/replay_server.py): `serve --record DIR` writes
the deployment's arguments beside the requests (never where it listens, its keys or the
recording itself), and `replay` starts that deployment again on a free port, waits for its
guarantee, replays and stops it. A recording replays identical; a copy with one altered token
diverges at that token (the control); a copy as a host of another kind (another backend in its
fingerprint, other tokens) would have recorded it is not comparable, with the reason; a
recording without deployment.json is a clear error.
"""
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from openai import OpenAI

from lockstep.server.commands import replay as replay_command
from lockstep.server.tools import replay_server

SERVE = ["--batch-invariant-limit", "4", "--max-active", "2", "--prefill-chunk", "16",
         "--max-batch-rows", "8"]  # two requests of at most L rows each: the ragged proof covers 1..8, not 1..32


def test_deployment_args_leave_out_address_keys_and_the_recording():
    argv = ["lockstep", "serve", "--model", "m", "--host", "0.0.0.0", "--port=9", "--api-key", "secret",
            "--api-key=other", "--record", "/r", "--batch-invariant-limit", "8", "--record=/s"]
    assert replay_server.deployment_args(argv) == ["--model", "m", "--batch-invariant-limit", "8"]


def test_a_recording_without_its_deployment_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "requests.jsonl").write_text("")
    args = SimpleNamespace(files=[str(tmp_path / "requests.jsonl")], url=None, api_key=None,
                           without_speculation=False, json=False, timeout=30.0, start_timeout=30.0)
    assert replay_command.run(args) == 2
    assert "deployment.json not found" in capsys.readouterr().err


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    directory = tmp_path_factory.mktemp("recorded")
    with replay_server.started([*SERVE, "--record", str(directory)], timeout=600) as url:
        client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
        story = [{"role": "user", "content": "Tell me a story about a fox."}]
        client.chat.completions.create(model="default", messages=story, max_tokens=6, temperature=0,
                                       extra_body={"deterministic": True})
        client.chat.completions.create(model="default", messages=story, max_tokens=6, temperature=0.9,
                                       extra_body={"deterministic": True})  # the server draws the seed
    return directory


def test_serve_record_writes_the_deployment_without_where_it_listens(recording):
    written = json.loads((recording / "deployment.json").read_text())["serve_args"]
    assert written == SERVE


def other_backend_fingerprint(model_dir) -> tuple[str, str]:
    """(this backend's, a CUDA host's) fingerprint of one deployment: only the backend differs."""
    import mlx.core as mx

    from lockstep.server.fingerprint import system_fingerprint

    settings = dict(transform="none", strategy="cpu_kernel", limit=4, blas="openblas", prefill_chunk=16)
    here = system_fingerprint(model_dir, **settings)
    real = mx.default_device
    mx.default_device = lambda: "Device(gpu, 0)"
    try:
        return here, system_fingerprint(model_dir, **settings)
    finally:
        mx.default_device = real


@pytest.fixture(scope="module")
def replayed(recording, embedded_model):
    """One `lockstep replay` (the recorded deployment started again) of three files: the
    recording; a copy with one token altered (the control); a copy as a host of another kind
    would have recorded it: its receipts carry that host's fingerprint and its tokens differ."""
    lines = (recording / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 2
    altered = [json.loads(line) for line in lines]
    altered[1]["choices"][0]["token_ids"][3] += 1
    # beside the original: the same deployment.json
    (recording / "altered.jsonl").write_text("".join(json.dumps(e) + "\n" for e in altered))
    here, cuda = other_backend_fingerprint(embedded_model.path)
    assert here != cuda  # the backend is part of the fingerprint
    other_host = [json.loads(line) for line in lines]
    for entry in other_host:
        for choice in entry["choices"]:
            choice["receipt"]["system_fingerprint"] = cuda
            choice["token_ids"][0] += 1
    (recording / "other_host.jsonl").write_text("".join(json.dumps(e) + "\n" for e in other_host))
    done = subprocess.run([sys.executable, "-m", "lockstep.server.cli", "replay", str(recording / "requests.jsonl"),
                           str(recording / "altered.jsonl"), str(recording / "other_host.jsonl"), "--json",
                           "--start-timeout", "600"], capture_output=True, text=True, timeout=900)
    verdicts = json.loads(done.stdout)
    return SimpleNamespace(done=done, by_file=lambda name: [v for v in verdicts if v["file"].endswith("/" + name)])


def test_replay_starts_the_recorded_deployment_and_finds_it_identical(replayed):
    outcomes = [(v["file"].rsplit("/", 1)[-1], v["line"], v["outcome"], v["index"])
                for v in replayed.by_file("requests.jsonl") + replayed.by_file("altered.jsonl")]
    assert outcomes == [("requests.jsonl", 1, "identical", None), ("requests.jsonl", 2, "identical", None),
                        ("altered.jsonl", 1, "identical", None), ("altered.jsonl", 2, "diverged", 3)], \
        replayed.done.stderr
    assert replayed.done.returncode == 1  # a diverged answer fails the replay
    assert "the recorded deployment serves at http://127.0.0.1:" in replayed.done.stderr


def test_a_recording_from_a_host_of_another_kind_is_not_comparable_and_says_why(replayed):
    verdicts = replayed.by_file("other_host.jsonl")
    assert [v["outcome"] for v in verdicts] == ["not comparable", "not comparable"], replayed.done.stderr
    for v in verdicts:  # never a divergence at token 0, never identical
        assert v["reason"].startswith("another system_fingerprint (kernels, backend, MLX or settings)")
        assert v["index"] is None
