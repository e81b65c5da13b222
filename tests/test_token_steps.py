"""token_steps.make_source: a request's decode inputs and its speculation, grouped."""
import inspect

from lockstep.server.engine.decoding.sampling import SamplingParams
from lockstep.server.engine.decoding.drafters import DraftModelDrafter, PredictionDrafter, PromptLookupDrafter
from lockstep.server.engine.decoding.token_steps import (DecodeInputs, PlainSource, Speculation, SpeculationStats,
                                                SpeculativeSource, make_source)

GREEDY = SamplingParams(temperature=0.0)


class _Layers:
    def __init__(self, n: int):
        self.layers = [None] * n


def test_make_source_takes_the_inputs_the_stats_and_the_speculation():
    assert list(inspect.signature(make_source).parameters) == ["inputs", "stats", "speculation"]


def test_no_speculation_is_a_plain_source_over_the_inputs():
    cache, context, processors = [], [1, 2, 3], object()
    source = make_source(DecodeInputs(cache, context, GREEDY, processors), SpeculationStats())
    assert isinstance(source, PlainSource)
    assert source.cache is cache and source.context is context and source.processors is processors


def test_the_speculation_settings_reach_the_source_and_its_policy():
    remaining, cancelled = (lambda: 7), (lambda: False)
    inputs = DecodeInputs([], [5, 6], GREEDY, remaining=remaining, cancelled=cancelled)
    lookup = make_source(inputs, SpeculationStats(), Speculation("prompt_lookup", 3, backoff=True))
    assert isinstance(lookup, SpeculativeSource) and isinstance(lookup.drafter, PromptLookupDrafter)
    assert lookup.k == 3 and lookup.backoff is not None and lookup.adaptive is None
    assert lookup.remaining is remaining and lookup.cancelled is cancelled

    predicted = make_source(inputs, SpeculationStats(),
                            Speculation("prediction", 4, adaptive=True, prediction=(9, 8), pass_costs=[1.0] * 5))
    assert isinstance(predicted.drafter, PredictionDrafter) and predicted.adaptive is not None
    assert predicted.adaptive.draft_cost == 0.0  # a prediction's drafts cost no passes

    measured = make_source(inputs, SpeculationStats(), Speculation("draft", 2, adaptive=True, draft_model=_Layers(1),
                                                                  target=_Layers(4), draft_cost=0.5))
    assert isinstance(measured.drafter, DraftModelDrafter) and measured.adaptive.draft_cost == 0.5
    estimated = make_source(inputs, SpeculationStats(), Speculation("draft", 2, adaptive=True, draft_model=_Layers(1),
                                                                   target=_Layers(4)))
    assert estimated.adaptive.draft_cost == 0.25  # by depth, where nothing was measured
