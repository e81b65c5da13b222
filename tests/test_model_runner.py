"""The model runner's choice of forms for a pass of prompt chunks (server/engine/runner/model_runner.py
`prompt_forms`): native only where every request's prompt runs them (a plain prompt where the
deployment says so); a pass holding any other chunk keeps the model's setting, so a canonical
chunk sharing it keeps its bits."""
from types import SimpleNamespace

from lockstep.kernels.invariance import layers
from lockstep.server.engine.runner.model_runner import prompt_forms


def native_inside(states) -> bool:
    with prompt_forms(states):
        return layers._local.native


def test_a_pass_runs_native_forms_only_where_every_prompt_does():
    plain, canonical = SimpleNamespace(native_prompt=True), SimpleNamespace(native_prompt=False)
    assert native_inside([plain]) and native_inside([plain, plain])
    assert not native_inside([plain, canonical]) and not native_inside([canonical])
    assert not native_inside([])  # a draft model's chunk: as before
    assert not layers._local.native  # given back after the pass
