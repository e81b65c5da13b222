"""The HTTP load bench's client mix and its "changed answers" count (server/tools/http_load.py)."""
import pytest

from lockstep.server.tools.http_load import (RoundResult, changed_answers, extra_for, mixed_extra, run_round,
                                             solo_texts, summary_line)
from tests.http_server import deterministic_server

L = 6  # as tests/test_sampling_fields.py: the session's cached proofs for this L are re-used


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
