"""Incremental decoding (real tokenizer) and stop-sequence matching with hold-back."""
import random

import pytest

from lockstep.server.engine.decoding.stops import IncrementalDecoder, StopTextStream


class PieceDecoder:
    """Token id i decodes to pieces[i] (the IncrementalDecoder interface)."""

    def __init__(self, pieces):
        self.pieces = pieces

    def add(self, token):
        return self.pieces[token]

    def finish(self):
        return ""


def run(pieces, stops):
    """Feed every piece; returns (releases, stopped)."""
    stream = StopTextStream(PieceDecoder(pieces), stops)
    releases = []
    for token in range(len(pieces)):
        release = stream.add(token, item=token)
        releases.append(release)
        if release.stopped:
            return releases, True
    releases.append(stream.finish())
    return releases, False


def test_stop_split_across_tokens_is_caught_and_excluded():
    releases, stopped = run(["Hel", "lo", " wo", "rld", "!"], ["o wor"])
    assert stopped
    assert "".join(r.text for r in releases) == "Hell"
    assert len(releases) == 4  # stopped at the token completing the stop string


def test_prefix_of_stop_is_held_back_then_released():
    releases, stopped = run(["abc E", "N", "X"], ["END"])
    assert not stopped
    assert [r.text for r in releases] == ["abc ", "", "ENX", ""]


def test_finish_flushes_held_back_text():
    releases, stopped = run(["x", "E"], ["EOF"])
    assert not stopped
    assert [r.text for r in releases] == ["x", "", "E"]


def test_earliest_of_several_stops_wins():
    releases, stopped = run(["a b c d"], ["c", "b", "zz"])
    assert stopped
    assert releases[0].text == "a "


def test_items_of_tokens_that_only_made_the_stop_are_dropped():
    releases, stopped = run(["one", " two", "ST", "OP", " three"], ["STOP"])
    assert stopped
    items = [item for r in releases for item in r.items]
    assert items == [0, 1]
    offsets = [o for r in releases for o in r.offsets]
    assert offsets == [0, 3]


def test_held_back_items_wait_for_their_text():
    stream = StopTextStream(PieceDecoder(["ok", "<"]), ["<end>"])
    assert stream.add(0, item="a").items == ["a"]
    assert stream.add(1, item="b").items == []  # "<" might start the stop string
    final = stream.finish()
    assert final.text == "<" and final.items == ["b"] and final.offsets == [2]


def reference(pieces, stops):
    """Generation ends at the first token whose text completes a stop string; the output
    is cut where the earliest complete stop string starts."""
    text = ""
    for piece in pieces:
        text += piece
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[: min(hits)], True
    return text, False


def test_random_streams_match_reference_and_never_leak_past_a_stop():
    rng = random.Random(1234)
    for _ in range(500):
        pieces = ["".join(rng.choice("ab c") for _ in range(rng.randint(0, 3))) for _ in range(12)]
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 4))]
        expected, expect_stop = reference(pieces, stops)
        releases, stopped = run(pieces, stops)
        sent = ""
        for release in releases:
            sent += release.text
            assert expected.startswith(sent), (pieces, stops, sent)
        assert sent == expected
        assert stopped == expect_stop


def test_incremental_decoding_matches_decoding_all_at_once(embedded_model):
    tokenizer = embedded_model.tokenizer
    prompt = tokenizer.encode("The sky is")
    generated = tokenizer.encode(" blue, 青い空 🌤️ and\nvery   wide.", add_special_tokens=False)
    decoder = IncrementalDecoder(tokenizer, prompt)
    pieces = [decoder.add(t) for t in generated]
    text = "".join(pieces) + decoder.finish()
    assert text == tokenizer.decode(prompt + generated)[len(tokenizer.decode(prompt)) :]
    assert text.startswith(" blue")  # the leading space of a continuation is kept
    assert not any("\ufffd" in piece for piece in pieces)  # split characters wait


@pytest.mark.parametrize("window", [5, 6, IncrementalDecoder.WINDOW])
def test_incremental_decoding_matches_decoding_all_at_once_as_its_window_moves(embedded_model, monkeypatch, window):
    """A long answer: the window moves on many times, also inside split characters."""
    monkeypatch.setattr(IncrementalDecoder, "WINDOW", window)
    tokenizer = embedded_model.tokenizer
    prompt = tokenizer.encode("The sky is")
    generated = tokenizer.encode(" blue, 青い空 🌤️ and\nvery   wide. " * 12, add_special_tokens=False)
    assert len(generated) > 4 * IncrementalDecoder.WINDOW
    decoder = IncrementalDecoder(tokenizer, prompt)
    pieces = [decoder.add(t) for t in generated]
    text = "".join(pieces) + decoder.finish()
    assert text == tokenizer.decode(prompt + generated)[len(tokenizer.decode(prompt)) :]
    assert not any("\ufffd" in piece for piece in pieces)


def test_direct_decode_gives_the_wrapper_text(embedded_model):
    from lockstep.server.engine.decoding.stops import direct_decode

    tokenizer = embedded_model.tokenizer
    ids = tokenizer.encode("<|im_start|>user\nHi — 青い空 🌤️\n```py\nx  =  1\n```<|im_end|>")
    decode = direct_decode(tokenizer, ids)
    assert decode is not tokenizer.decode  # the embedded tokenizer takes the direct path
    for cut in range(1, len(ids) + 1):
        assert decode(ids[:cut]) == tokenizer.decode(ids[:cut])


def test_direct_decode_keeps_the_wrapper_where_it_would_differ(embedded_model, monkeypatch):
    from lockstep.server.engine.decoding.stops import direct_decode

    tokenizer = embedded_model.tokenizer
    hf = tokenizer._tokenizer
    ids = tokenizer.encode("some text")
    monkeypatch.setattr(hf, "clean_up_tokenization_spaces", True, raising=False)
    assert direct_decode(tokenizer, ids) == tokenizer.decode  # clean-up is transformers' job
    monkeypatch.setattr(hf, "clean_up_tokenization_spaces", False, raising=False)

    class Shifted:  # a wrapper whose text differs from its backend's: the probe catches it
        _tokenizer = hf

        def decode(self, ids):
            return "x" + hf.decode(ids)

    shifted = Shifted()
    assert direct_decode(shifted, ids)(ids) == shifted.decode(ids) == "x" + hf.decode(ids)
