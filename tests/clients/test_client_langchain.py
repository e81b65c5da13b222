"""langchain-openai's ChatOpenAI: invoke, stream, bind_tools (and the tool result sent back),
with_structured_output (json_schema, the default, and function calling)."""
from typing import Literal

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel


class Verdict(BaseModel):
    """Whether the statement is true."""

    answer: Literal["yes", "no"]


@tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return "18 C and sunny"


@pytest.fixture(scope="module")
def llm(base_url, api_key):
    def make(max_tokens=8):
        return ChatOpenAI(model="default", base_url=base_url, api_key=api_key, max_tokens=max_tokens,
                          temperature=0, max_retries=0, timeout=300)

    return make


def test_invoke(llm):
    message = llm().invoke("Say hi.")
    assert isinstance(message, AIMessage) and message.content
    assert message.usage_metadata["output_tokens"] == 8
    assert message.response_metadata["finish_reason"] == "length"


def test_stream_is_the_invoked_answer(llm):
    model = llm()
    assert "".join(chunk.content for chunk in model.stream("Say hi.")) == model.invoke("Say hi.").content


def test_bind_tools_calls_the_tool_and_takes_its_result(llm):
    model = llm(40).bind_tools([get_weather], tool_choice="get_weather")
    question = HumanMessage("What is the weather in Paris?")
    called = model.invoke([question])
    assert [call["name"] for call in called.tool_calls] == ["get_weather"]
    assert isinstance(called.tool_calls[0]["args"].get("city"), str) and called.tool_calls[0]["id"]
    result = ToolMessage(get_weather.invoke(called.tool_calls[0]["args"]), tool_call_id=called.tool_calls[0]["id"])
    answer = llm().bind_tools([get_weather]).invoke([question, called, result])
    assert isinstance(answer, AIMessage)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(llm, method):
    verdict = llm(40).with_structured_output(Verdict, method=method).invoke("Is water wet?")
    assert isinstance(verdict, Verdict)
