"""litellm's OpenAI-compatible route (`openai/<model>` with `api_base`): completion, stream,
tools (and the tool result sent back as the history litellm keeps)."""
import pytest

litellm = pytest.importorskip("litellm")  # conftest.py has set its offline switches by now

WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def complete(base_url, api_key):
    def call(messages, **kwargs):
        kwargs.setdefault("max_tokens", 8)
        return litellm.completion(model="openai/default", api_base=base_url, api_key=api_key, messages=messages,
                                  temperature=0, num_retries=0, timeout=300, **kwargs)

    return call


def test_completion(complete):
    response = complete([{"role": "user", "content": "Say hi."}])
    assert response.choices[0].message.content and response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 8


def test_stream(complete):
    whole = complete([{"role": "user", "content": "Say hi."}]).choices[0].message.content
    chunks = list(complete([{"role": "user", "content": "Say hi."}], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_tools_round_trip(complete):
    called = complete(WEATHER, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                      max_tokens=40)
    message = called.choices[0].message
    assert called.choices[0].finish_reason == "tool_calls" and message.tool_calls[0].function.name == "get_weather"
    history = WEATHER + [message.model_dump(),
                         {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 C and sunny"}]
    assert complete(history, tools=TOOLS).choices[0].message is not None
