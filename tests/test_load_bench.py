"""The HTTP load bench's client mix and its "changed answers" count (server/tools/http_load.py)."""
import pytest

from lockstep.server.tools import http_load
from lockstep.server.tools.http_load import (RoundResult, changed_answers, extra_for, mixed_extra, run_round,
                                             solo_texts, summary_line)
from tests.http_server import deterministic_server

L = 6  # as tests/test_sampling_fields.py: the session's cached proofs for this L are re-used


def test_each_lockstep_server_reports_its_passes_built_ahead(server, monkeypatch, tmp_path, capsys):
    """After its rounds the bench prints each lockstep server's decode passes built ahead, from
    its /metrics (the CPU builds none); a server it cannot read is "unknown", never a crash."""
    assert http_load.decode_ahead_line(server) == "built 0, taken 0, dropped 0"
    assert http_load.decode_ahead_line("http://127.0.0.1:9/v1").startswith("unknown (")
    run_load_without_servers(monkeypatch, tmp_path)
    printed = capsys.readouterr().out
    assert "lockstep: decode passes built ahead unknown (" in printed
    assert "mlx_lm.server: decode passes" not in printed


def test_each_lockstep_server_reports_its_decode_passes_by_kind(server, capsys):
    """After each concurrency's rounds the bench prints each lockstep server's decode passes
    of its measured rounds (not the warm one) by kind, from its /metrics: a deterministic
    client's passes count as deterministic ones, a plain one's as plain, one pass a token (the
    prompt's last token is the first pass's row)."""
    import argparse
    import re

    import lockstep.server.commands.bench as bench

    for kind, extra in (("deterministic", {"deterministic": True}), ("plain", {})):
        before = http_load.pass_seconds(server)
        out = bench._server_rounds([{"name": kind, "url": server, "model": "default", "extra": extra}], [1],
                                   argparse.Namespace(max_tokens=4, rounds=3))
        after = http_load.pass_seconds(server)
        passes = sum(r.tokens for r in out[kind][0][1])
        line = re.search(rf"{kind}: decode passes of the measured rounds at 1 clients: (.*)", capsys.readouterr().out)
        assert passes > 0 and line is not None
        assert re.search(rf"{kind} {passes} passes, \d+\.\d\d ms each", line.group(1)), line.group(1)
        other = "plain" if kind == "deterministic" else "deterministic"
        assert f"{other} 0" in line.group(1)
        assert after[kind][0] - before[kind][0] == passes + 4  # and the warm round's (not printed)
        assert after[kind][1] > before[kind][1]
    assert http_load.pass_seconds("http://127.0.0.1:9/v1") is None
    assert http_load.pass_seconds_line(None, after) == "unknown"


def test_extra_is_one_dict_or_a_function_of_the_client():
    assert extra_for({"deterministic": True}, 3) == {"deterministic": True}
    assert extra_for(None, 0) == {}
    assert [extra_for(mixed_extra, i) for i in range(3)] == [{"deterministic": True}, {}, {"deterministic": True}]


def test_changed_answers_can_count_only_the_watched_clients():
    r = RoundResult(4, 1.0, 0, [], [], 0, ["a", "X", "c", "Y"])
    solo = ["a", "b", "c", "d"]
    assert changed_answers(r, solo) == 2
    assert changed_answers(r, solo, {0, 2}) == 0 and changed_answers(r, solo, {1}) == 1
    assert summary_line("x", r, 0, 2).rstrip().endswith("0/2")


@pytest.fixture(scope="module")
def server(embedded_model):
    with deterministic_server(embedded_model, L) as (client, engine):
        yield str(client.base_url).rstrip("/")


def test_a_mixed_round_keeps_every_deterministic_answer(server):
    clients, tokens = 4, 6
    solo = solo_texts(server, "default", clients, tokens, mixed_extra)
    r = run_round(server, "default", clients, tokens, mixed_extra)
    assert r.errors == 0 and all(text for text in r.texts)
    deterministic = {i for i in range(clients) if mixed_extra(i)}
    assert deterministic == {0, 2} and changed_answers(r, solo, deterministic) == 0


def test_each_concurrency_is_warmed_then_the_median_of_three_rounds_is_reported(monkeypatch):
    """Warm with warm: the first round at a concurrency (where a server compiles its batched
    shapes) is never a measured one, and the figure is the median of at least three."""
    import lockstep.server.tools.http_load as http_load

    rates = iter([5.0, 30.0, 10.0, 20.0])  # the warm-up round, then three measured ones
    calls = []

    def fake_round(base_url, model, concurrency, max_tokens, extra=None, tag=None):
        calls.append(concurrency)
        return RoundResult(concurrency, 1.0, int(next(rates)), [], [], 0, [])

    monkeypatch.setattr(http_load, "run_round", fake_round)
    (median, rounds), = http_load.interleaved_rounds([("u", "m", None)], 16, 8, rounds=2)
    assert calls == [16, 16, 16, 16]  # one unmeasured round, then at least three
    assert [r.tok_per_s for r in rounds] == [30.0, 10.0, 20.0]
    assert median.tok_per_s == 20.0


def test_servers_side_by_side_are_warmed_then_measured_in_turn(monkeypatch):
    """A machine whose speed drifts moves every side alike: every server gets its unmeasured
    round first, then the measured rounds alternate A, B, A, B, ... and each side's median is its own."""
    import lockstep.server.tools.http_load as http_load

    rates = {"a": iter([1.0, 10.0, 30.0, 20.0]), "b": iter([2.0, 5.0, 7.0, 6.0])}
    calls = []

    def fake_round(base_url, model, concurrency, max_tokens, extra=None, tag=None):
        calls.append(base_url)
        tags.append(tag)
        return RoundResult(concurrency, 1.0, int(next(rates[base_url])), [], [], 0, [], tag)

    tags = []
    monkeypatch.setattr(http_load, "run_round", fake_round)
    (a, a_rounds), (b, b_rounds) = http_load.interleaved_rounds([("a", "m", {}), ("b", "m", {})], 16, 8, rounds=3)
    assert calls == ["a", "b", "a", "b", "a", "b", "a", "b"]
    # each round's prompts its own (none answered from a cached whole prompt), the same for both servers
    assert tags[0::2] == tags[1::2] and len(set(tags[0::2])) == 4
    assert len({http_load.prompt_for(0, tag=t) for t in tags}) == 4 and [r.tag for r in a_rounds] == tags[2::2]
    assert [r.tok_per_s for r in a_rounds] == [10.0, 30.0, 20.0] and a.tok_per_s == 20.0
    assert [r.tok_per_s for r in b_rounds] == [5.0, 7.0, 6.0] and b.tok_per_s == 6.0


def test_deterministic_servers_may_name_their_strategy():
    from lockstep.server.commands.bench import _deterministic_servers

    assert _deterministic_servers("8, 16,8:skinny") == [("det L=8", 8, None), ("det L=16", 16, None),
                                                        ("det L=8 skinny", 8, "skinny")]
    assert _deterministic_servers(None) == []
    for bad in ("0", "x", ":skinny", "-4:gemv_rows"):
        with pytest.raises(SystemExit):
            _deterministic_servers(bad)


def test_other_configurations_are_named_servers_with_their_own_serve_arguments():
    from lockstep.server.commands.bench import _config_servers

    assert _config_servers(["graphs=--cuda-graphs=on", "pool = --kv-pool off --max-batch-rows 8"]) == [
        ("graphs", ["--cuda-graphs=on"]), ("pool", ["--kv-pool", "off", "--max-batch-rows", "8"])]
    for bad in (["--cuda-graphs=on"], ["=--x"], ["lockstep=--x"], ["det8=--x"]):
        with pytest.raises(SystemExit):
            _config_servers(bad)


def test_ratios_of_rounds_taken_one_after_the_other_and_their_median():
    from types import SimpleNamespace as R

    from lockstep.server.commands.bench import paired_ratios

    pairs = [(R(tok_per_s=1258.0), R(tok_per_s=1126.7)), (R(tok_per_s=1256.7), R(tok_per_s=1307.0)),
             (R(tok_per_s=1389.6), R(tok_per_s=1745.9))]
    assert paired_ratios(pairs) == ", paired rounds 1.12 0.96 0.80, median 0.96"
    assert paired_ratios([]) == ""


def test_a_stream_that_ends_in_an_error_event_counts_as_an_error():
    """A failure after the headers (a 200) is the stream's last event: the bench counts it, not
    a request of zero tokens."""
    import http.server
    import threading

    from lockstep.server.tools.http_load import stream_chat

    class Failing(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
                             b'data: {"error": {"message": "generation failed: out of memory", "type": "server_error"}}\n\n')

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        timing = stream_chat(f"http://127.0.0.1:{httpd.server_port}/v1", "default", "hi", 4)
    finally:
        httpd.shutdown()
    assert timing.error and "out of memory" in timing.error


def run_load_without_servers(monkeypatch, model_dir, **overrides) -> tuple[list[str], dict]:
    """bench.run_load where `_start` only records each server's command line and every round
    is a stand-in: (events "start NAME" / "measure NAME+NAME" / "stop NAME" in order, each
    server's command line by name). `resolve_model` gives `model_dir`; overrides: run_load's
    arguments."""
    import argparse

    import lockstep.server.commands.bench as bench
    import lockstep.server.tools.http_load as http_load

    events, commands = [], {}

    class Proc:
        def __init__(self, name):
            self.name = name

        def terminate(self):
            events.append(f"stop {self.name}")

        def wait(self, timeout=None):
            return 0

    def start(cmd, log_path):
        name = "mlx_lm.server" if "mlx_lm.server" in cmd else "lockstep"
        events.append(f"start {name}")
        commands[name] = cmd
        return Proc(name)

    def rounds(servers, levels, args):
        events.append("measure " + "+".join(s["name"] for s in servers))
        r = RoundResult(levels[0], 1.0, 10, [], [], 0, [])
        return {s["name"]: [(r, [r, r, r])] for s in servers}

    monkeypatch.setattr(bench, "_start", start)
    monkeypatch.setattr(bench, "_server_rounds", rounds)
    monkeypatch.setattr(http_load, "wait_healthy", lambda *a, **k: None)
    monkeypatch.setattr("lockstep.models.resolve.resolve_model", lambda model, weights: model_dir)
    args = dict(concurrency="4", against_deterministic=None, against_config=[], model=str(model_dir),
                weights="auto", max_tokens=8, deterministic=False, mixed=False, out=None, against_mlx_lm=True,
                one_server_at_a_time=False, cuda_graphs="auto", serve_arg=[], batch_invariant_limit=0,
                cpu_blas="auto", rounds=3)
    assert bench.run_load(argparse.Namespace(**{**args, **overrides})) == 0
    return events, commands


@pytest.mark.parametrize("one_at_a_time", [False, True])
def test_servers_run_together_or_one_at_a_time(monkeypatch, tmp_path, one_at_a_time):
    """Side by side every server is up while the rounds alternate; one at a time each server
    is stopped before the next starts (a GPU that cannot hold them all), and every server's
    figures still reach the ratios."""
    events, _ = run_load_without_servers(monkeypatch, tmp_path, one_server_at_a_time=one_at_a_time)
    if one_at_a_time:
        assert events == ["start lockstep", "measure lockstep", "stop lockstep",
                          "start mlx_lm.server", "measure mlx_lm.server", "stop mlx_lm.server"]
    else:
        assert events == ["start lockstep", "start mlx_lm.server", "measure lockstep+mlx_lm.server",
                          "stop lockstep", "stop mlx_lm.server"]


@pytest.mark.parametrize("spec", ["default", "dir"])
def test_lockstep_serves_a_gguf_as_serve_would_import_it(monkeypatch, tmp_path, spec):
    """A GGUF spec (the default model's too) reaches `lockstep serve` as given, so the server
    imports it itself (--quantize from the float32 import, float32 parameters in the GPU's
    16-bit dtype); its import directory, served as it is, would keep float32. mlx_lm.server
    gets the directory; a directory spec reaches both as it is."""
    model_dir = tmp_path / "imported"
    model = "default" if spec == "default" else str(model_dir)
    _, commands = run_load_without_servers(monkeypatch, model_dir, model=model, serve_arg=["--quantize=nvfp4"])
    served = commands["lockstep"][commands["lockstep"].index("--model") + 1]
    assert served == model
    assert commands["mlx_lm.server"][commands["mlx_lm.server"].index("--model") + 1] == str(model_dir)
    if spec == "default":
        assert commands["lockstep"][commands["lockstep"].index("--weights") + 1] == "auto"
    else:
        assert "--weights" not in commands["lockstep"]


def test_each_rounds_answers_are_compared_with_its_own_requests_sent_alone_afterwards(monkeypatch, capsys):
    import argparse

    import lockstep.server.commands.bench as bench
    import lockstep.server.tools.http_load as http_load

    order = []

    def fake_round(base_url, model, concurrency, max_tokens, extra=None, tag=None):
        order.append(("round", tag))
        return RoundResult(concurrency, 1.0, 8, [], [], 0, [f"{tag}:{i}" for i in range(concurrency)], tag)

    def fake_solo(base_url, model, n, max_tokens, extra=None, tag=None):
        order.append(("solo", tag))
        return [f"{tag}:{i}" if i else "another answer" for i in range(n)]  # client 0 changed each round

    monkeypatch.setattr(http_load, "run_round", fake_round)
    monkeypatch.setattr(http_load, "solo_texts", fake_solo)
    out = bench._server_rounds([{"name": "lockstep", "url": "u", "model": "m", "extra": {}}], [2],
                               argparse.Namespace(max_tokens=8, rounds=3))
    solos = [tag for kind, tag in order if kind == "solo"]
    assert solos == [r.tag for r in out["lockstep"][0][1]] and len(set(solos)) == 3
    assert [kind for kind, _ in order] == ["round"] * 4 + ["solo"] * 3  # alone only after the measured rounds
    assert "3/6" in capsys.readouterr().out


def _health_server(answers: list[tuple[int, dict]]):
    """A /health that gives `answers` in turn (the last one from then on); returns (url, asked)."""
    import http.server
    import json
    import threading

    asked = []

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            status, body = answers[min(len(asked), len(answers) - 1)]
            asked.append(body)
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}", asked


def test_wait_healthy_waits_for_the_start_up_work_after_the_guarantee():
    """A measurement starts once the server's start-up work is done, not only its guarantee: the
    batched-sampling proof runs after the guarantee is in force, and until it has, deterministic
    rows sample one at a time."""
    server, url, asked = _health_server([(200, {"status": "ok", "guarantee": "proving", "starting": True}),
                                         (200, {"status": "ok", "guarantee": "in_force", "starting": True}),
                                         (200, {"status": "ok", "guarantee": "in_force", "starting": False})])
    try:
        http_load.wait_healthy(url, "/health", 30)
        assert len(asked) == 3
    finally:
        server.shutdown()


def test_wait_healthy_stops_at_a_failed_engine():
    server, url, asked = _health_server([(503, {"status": "failed", "error": "RuntimeError: device"})])
    try:
        with pytest.raises(RuntimeError, match="the engine failed: RuntimeError: device"):
            http_load.wait_healthy(url, "/health", 30)
        assert len(asked) == 1
    finally:
        server.shutdown()
