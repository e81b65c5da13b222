"""bench/harness.py: the measuring loop the bench scripts share (warm-up, rotated rounds,
medians, paired ratios, markdown)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import harness  # noqa: E402


def _recorder(calls: list, name: str):
    def variant():
        calls.append(name)
        return calls.count(name)  # its own call count: shows which calls were measured
    return variant


def test_every_variant_leads_a_round_in_turn():
    calls = []
    variants = {n: _recorder(calls, n) for n in ("a", "b", "c")}
    harness.measure(variants, rounds=3, warmup=0)
    firsts = [calls[i] for i in range(0, 9, 3)]
    assert sorted(firsts) == ["a", "b", "c"]
    assert calls[3:6] == ["b", "c", "a"]


def test_the_warm_up_rounds_are_run_and_left_out():
    calls = []
    results = harness.measure({"a": _recorder(calls, "a"), "b": _recorder(calls, "b")}, rounds=2, warmup=1)
    assert results == {"a": [2, 3], "b": [2, 3]}
    assert len(calls) == 6


def test_a_ratio_is_the_median_of_the_rounds_own_ratios():
    results = {"base": [1.0, 8.0, 3.0], "new": [1.0, 4.0, 9.0]}
    assert harness.paired_ratios(results, "new", "base") == [1.0, 0.5, 3.0]
    # the ratio of the medians would read 4 / 3; the rounds' own ratios give 1
    row = next(line for line in harness.summary(results, "base").splitlines() if line.startswith("| new |"))
    assert row.endswith("| 1.000 |")


def test_value_picks_one_figure_of_a_tuple():
    results = {"base": [(1.0, 2.0), (1.0, 4.0)], "new": [(9.0, 1.0), (9.0, 2.0)]}
    assert harness.paired_ratios(results, "new", "base", value=lambda m: m[1]) == [0.5, 0.5]
    assert harness.median(results["new"], value=lambda m: m[0]) == 9.0


def test_the_table_is_markdown():
    assert harness.table(["x", "y"], [[1, "2.00"]]) == "| x | y |\n|---|---|\n| 1 | 2.00 |"


def test_timed_measures_a_callable_in_seconds():
    done = []
    seconds = harness.timed(lambda: done.append(1))()
    assert done == [1] and 0 <= seconds


def test_nothing_to_measure_is_an_error():
    with pytest.raises(ValueError):
        harness.measure({"a": lambda: 1.0}, rounds=0)
    with pytest.raises(ValueError):
        harness.measure({}, rounds=1)


class _Delta:
    def __init__(self, completion_tokens: int):
        self.completion_tokens = completion_tokens


class _Engine:
    """Submissions and reads in the order they happen; request r's answer is r deltas, its
    last one counting r completion tokens."""

    def __init__(self):
        self.events = []

    def submit(self, request, plan):
        self.events.append(("submit", request, plan))
        return self._answer(request)

    async def _answer(self, request):
        for n in range(1, request + 1):
            self.events.append(("read", request))
            yield _Delta(n)


def test_drive_submits_every_request_before_reading_and_counts_their_tokens():
    import asyncio

    engine = _Engine()
    tokens = asyncio.run(harness.drive(engine, [2, 3, 1], ["p0", "p1", "p2"]))
    assert tokens == 2 + 3 + 1  # each answer's last delta
    assert engine.events[:3] == [("submit", 2, "p0"), ("submit", 3, "p1"), ("submit", 1, "p2")]
    assert sorted(e for e in engine.events[3:]) == [("read", 1), ("read", 2), ("read", 2), ("read", 3),
                                                    ("read", 3), ("read", 3)]


def test_the_lockstep_command_is_the_venvs_script_where_there_is_one(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "ROOT", tmp_path)
    assert harness.lockstep_command() == [sys.executable, "-m", "lockstep.server.cli"]  # the staged GPU
    script = tmp_path / ".venv/bin/lockstep"
    script.parent.mkdir(parents=True)
    script.touch()
    assert harness.lockstep_command() == [str(script)]
