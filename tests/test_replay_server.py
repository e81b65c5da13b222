"""`lockstep replay` without `--url` (server/tools/replay_server.py): `serve --record DIR` writes
the deployment's arguments beside the requests (never where it listens, its keys or the
recording itself), and `replay` starts that deployment again on a free port, waits for its
guarantee, replays and stops it. A recording replays identical; a copy with one altered token
diverges at that token (the control); a recording without deployment.json is a clear error.
"""
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from openai import OpenAI

from lockstep.server.commands import replay as replay_command
from lockstep.server.tools import replay_server

SERVE = ["--batch-invariant-limit", "4", "--max-active", "2", "--prefill-chunk", "16"]


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


def test_replay_starts_the_recorded_deployment_and_finds_it_identical(recording, tmp_path):
    lines = (recording / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 2
    altered = [json.loads(line) for line in lines]
    altered[1]["choices"][0]["token_ids"][3] += 1
    control = recording / "altered.jsonl"  # beside the original: the same deployment.json
    control.write_text("".join(json.dumps(e) + "\n" for e in altered))
    done = subprocess.run([sys.executable, "-m", "lockstep.server.cli", "replay", str(recording / "requests.jsonl"),
                           str(control), "--json", "--start-timeout", "600"],
                          capture_output=True, text=True, timeout=900)
    verdicts = json.loads(done.stdout)
    outcomes = [(v["file"].rsplit("/", 1)[-1], v["line"], v["outcome"], v["index"]) for v in verdicts]
    assert outcomes == [("requests.jsonl", 1, "identical", None), ("requests.jsonl", 2, "identical", None),
                        ("altered.jsonl", 1, "identical", None), ("altered.jsonl", 2, "diverged", 3)], done.stderr
    assert done.returncode == 1  # a diverged answer fails the replay
    assert "the recorded deployment serves at http://127.0.0.1:" in done.stderr
