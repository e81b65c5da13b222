"""Every mlx-lm family people serve is served, batched: dense, MoE, sliding-window and hybrid
(recurrent or conv state) models, from tiny random-weight models of mlx-lm's own classes
(tests/model_families.py).

Layers with per-request state (ArraysCache, RotatingKVCache) run once per request inside a
ragged pass (kernels/batching/ragged.py); the attention layers with plain KV caches run once
for the whole pass. Each request's batched answer is its solo answer, token for token
(greedy, with a peaked output head so no near-tie decides a token).
"""
import asyncio

import mlx.core as mx
import pytest

from lockstep.kernels.batching.ragged import ragged_problem
from lockstep.server.engine import Engine
from lockstep.server.engine.decode_plan import RequestRejected, plan_request
from lockstep.server.engine.deployment import Deployment
from lockstep.server.engine.generate import generate
from lockstep.server.engine.request_state import GenerationRequest
from lockstep.server.engine.sampling import SamplingParams
from lockstep.server.runtime import rewindable
from tests.deterministic_fixtures import TinyLoaded
from tests.model_families import FAMILIES, tiny_family

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [list(range(1, 12)), [40, 41, 42, 40, 41, 42, 40], list(range(100, 131))]
TOKENS = 8


def peaked(model):
    """The family's model with its output head scaled up: greedy answers far from ties."""
    head = getattr(model, "lm_head", None)
    if head is not None and hasattr(head, "weight"):
        head.weight = head.weight * 8
    mx.eval(model.parameters())
    return model


def ids(text: str) -> list[int]:
    return [ord(c) - 0x4E00 for c in text]


def solo(loaded, deployment, prompt) -> list[int]:
    request = GenerationRequest(prompt, TOKENS, GREEDY)
    return ids("".join(d.text for d in generate(loaded, request, deployment=deployment) if d))


def batched(loaded, deployment, prompts) -> tuple[list[list[int]], dict, int]:
    """All prompts at once through the engine: (answers, engine description, widest pass)."""
    widest = []
    observer = type("O", (), {"on_pass": lambda s, rows, n: widest.append(n)})()

    async def main():
        engine = Engine(loaded, max_active=4, deployment=deployment)
        engine.observers.append(observer)
        engine.start()
        try:
            plan = plan_request(deployment, deterministic=False, speculative=None, num_draft_tokens=None)
            handles = [engine.submit(GenerationRequest(p, TOKENS, GREEDY), plan) for p in prompts]
            out = []
            for handle in handles:
                text = ""
                async for delta in handle:
                    text += delta.text
                out.append(ids(text))
            return out, engine.describe()
        finally:
            engine.stop()

    answers, described = asyncio.run(main())
    return answers, described, max(widest)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_is_served_batched_with_its_solo_answers(family):
    model = peaked(tiny_family(family))
    loaded = TinyLoaded(model)
    deployment = Deployment(prefill_chunk=8, speculation=rewindable(model))
    alone = [solo(loaded, deployment, p) for p in PROMPTS]
    together, described, widest = batched(loaded, deployment, PROMPTS)
    assert described["batched"] is True and ragged_problem(model) is None
    assert widest >= 2  # requests really shared passes
    assert all(len(a) == TOKENS for a in alone)
    assert together == alone


@pytest.mark.parametrize("family", ["qwen3_next", "lfm2", "gemma3_text"])
def test_state_that_cannot_be_rewound_turns_speculation_off_by_name(family):
    model = tiny_family(family)
    assert not rewindable(model)
    deployment = Deployment(speculation=False, speculative="prompt_lookup")
    assert plan_request(deployment, deterministic=False, speculative=None, num_draft_tokens=None).method == "none"
    with pytest.raises(RequestRejected) as info:
        plan_request(deployment, deterministic=False, speculative="prompt_lookup", num_draft_tokens=3)
    assert info.value.param == "speculative" and "cannot be rewound" in str(info.value)


def test_plain_kv_families_keep_speculation():
    assert rewindable(tiny_family("llama")) and rewindable(tiny_family("qwen3_moe"))
