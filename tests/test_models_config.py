"""Which models `serve` serves (server/commands/models_config.py): repeated --model NAME=SPEC,
--models-config JSON/TOML, per-model options; one plain --model stays the single-model server."""
from __future__ import annotations

import argparse
import json

import pytest

from lockstep.server.commands.models_config import model_entries, several_models


def serve_args(*argv: str) -> argparse.Namespace:
    from lockstep.server.commands import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_one_plain_model_is_the_single_model_server():
    assert serve_args().model == "default" and not several_models(serve_args())
    assert serve_args("--model", "some/dir").model == "some/dir"
    assert not several_models(serve_args("--model", "some/dir"))
    assert several_models(serve_args("--model", "a=default"))  # a name: the pool, to serve it under
    assert several_models(serve_args("--idle-unload", "5"))


def test_repeated_models_and_a_config_file_with_per_model_options(tmp_path):
    config = tmp_path / "models.json"
    config.write_text(json.dumps({"models": [{"name": "q4", "model": "default", "quantize": "affine", "q_bits": 4}]}))
    entries = model_entries(serve_args("--model", "a=default", "--model", "b=/x/y", "--weights", "float32",
                                       "--models-config", str(config)))
    assert [e.name for e in entries] == ["a", "b", "q4"]
    assert entries[1].options["model"] == "/x/y" and entries[1].options["weights"] == "float32"  # the command line's
    assert entries[2].options["quantize"] == "affine" and entries[2].options["q_bits"] == 4
    assert entries[0].options["quantize"] is None  # per model: not another model's
    toml = tmp_path / "models.toml"
    toml.write_text('[[models]]\nname = "t"\nmodel = "default"\ndraft_model = "default-quantized"\n')
    (entry,) = model_entries(serve_args("--models-config", str(toml)))
    assert entry.name == "t" and entry.options["draft_model"] == "default-quantized"


@pytest.mark.parametrize("content, message", [
    ('{"models": [{"model": "default", "batch": 3}]}', "unknown model option 'batch'"),
    ('{"models": [{"name": "x"}]}', 'needs "model"'),
    ('{"models": [{"model": "default", "q_bits": "4"}]}', "'q_bits' must be an integer"),
    ('{"models": []}', 'needs "models"'),
    ('{"models": [', "not valid JSON"),
])
def test_bad_config_is_a_clear_error(tmp_path, content, message):
    config = tmp_path / "models.json"
    config.write_text(content)
    with pytest.raises(ValueError, match=message):
        model_entries(serve_args("--models-config", str(config)))


def test_two_models_under_one_name_are_refused():
    with pytest.raises(ValueError, match="two models are served as 'a'"):
        model_entries(serve_args("--model", "a=default", "--model", "a=/x"))
