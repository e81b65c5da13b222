"""pydantic-ai's OpenAI chat model (`OpenAIChatModel` + `OpenAIProvider(base_url=...)`): a text
run, a streamed run, and structured output (its output tool: a forced tool call, its result
sent back)."""
from typing import Literal

import pytest
from pydantic import BaseModel

pydantic_ai = pytest.importorskip("pydantic_ai")
from pydantic_ai import Agent  # noqa: E402
from pydantic_ai.models.openai import OpenAIChatModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402


class Verdict(BaseModel):
    answer: Literal["yes", "no"]


@pytest.fixture(scope="module")
def model(base_url, api_key):
    return OpenAIChatModel("default", provider=OpenAIProvider(base_url=base_url, api_key=api_key))


def test_a_text_run(model):
    result = Agent(model, model_settings={"max_tokens": 8, "temperature": 0}).run_sync("Say hi.")
    assert isinstance(result.output, str) and result.output
    assert result.usage.output_tokens == 8


def test_a_streamed_run(model):
    import asyncio

    async def run():
        agent = Agent(model, model_settings={"max_tokens": 8, "temperature": 0})
        async with agent.run_stream("Say hi.") as stream:
            return [text async for text in stream.stream_text(delta=True)]

    assert "".join(asyncio.run(run()))


def test_structured_output_through_its_output_tool(model):
    agent = Agent(model, output_type=Verdict, model_settings={"max_tokens": 40, "temperature": 0})
    result = agent.run_sync("Is water wet?")
    assert isinstance(result.output, Verdict)
