"""Issue 57: do the clients people use get deterministic answers from lockstep at their defaults?

    python3 -m venv /work/clientenv && /work/clientenv/bin/pip install openai httpx instructor \
        openai-agents langchain-openai langgraph 'litellm[proxy]' dspy llama-index-llms-openai-like \
        smolagents haystack-ai autogen-agentchat 'autogen-ext[openai]' outlines mirascope
    (cd /work/clientenv_js && npm install openai ai @ai-sdk/openai @ai-sdk/openai-compatible \
        @langchain/openai @langchain/core)   # CLIENTS_JS_DIR
    /work/clientenv/bin/python bench/clients_deterministic.py [--lockstep .venv/bin/lockstep] \
        [--only NAME,NAME] [-- serve args, default: --batch-invariant-limit 4]

instructor, marvin and pydantic-ai in a venv of their own (beside the rest pip picked instructor
1.3.2, which imports a mistralai module that is gone, and pydantic-ai 1.30.1,
which cannot be imported beside the OpenTelemetry API 1.45 it also picked: `opentelemetry._events`
is gone); alone, pip picks pydantic-ai 2, which marvin 3.2.7 cannot import (`pydantic_ai.usage.Usage`
is gone), and on 1.107 marvin fails before its request (`ModelResponsePartsManager()` lacks a
required argument). 1.30.1 with an older OpenTelemetry API works:
    python3 -m venv /work/clientenv_marvin && /work/clientenv_marvin/bin/pip install marvin httpx \
        instructor 'pydantic-ai==1.30.1' 'opentelemetry-api<1.40'
    /work/clientenv_marvin/bin/python bench/clients_deterministic.py --only openai,instructor,marvin,pydantic-ai

(run with the clients' own venv, never the project's: it starts `lockstep serve` from
`--lockstep`). One server of the embedded model with `--record DIR`. Each client is used at
its defaults (its own default temperature and so on) with only `deterministic: true` added
through its own extra-body mechanism, or, where it has none or drops it, the model name
`default:deterministic`. What the server did is read from the recording (a client may drop
the response's `lockstep` object): the request's status, whether the guarantee covered every
answer (`receipt.guaranteed`), and the seed (drawn by the server when the client sent none).
Then the same client asks again with that seed (through the same mechanism, or its own seed
setting), and the answer must be the same: the token ids and the receipt's `answer` and
`logprobs` digests recorded for both, and the text the client returned. A client that writes
another prompt each call (ids drawn per call) is checked by `lockstep replay` of its recorded
request instead.

Prints a markdown table: client, version, how deterministic was asked, status, guaranteed,
reproduced, and a note (the error, when a client failed).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Loopback only: litellm (and dspy through it) would fetch its model price list from the network.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
PROMPT = "Name one colour of the sky, in a few words."
QUESTION = [{"role": "user", "content": PROMPT}]
MAX_TOKENS = 12


def version(dist: str) -> str:
    if dist.startswith("npm:"):  # "npm:a+b": each package's version
        names = dist[4:].split("+")
        found = [js_version(name) for name in names]
        if "not installed" in found:
            return "not installed"
        return found[0] if len(names) == 1 else " + ".join(f"{n} {v}" for n, v in zip(names, found))
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


# Each client: (name, distribution, how, ask) where ask(base, extra, model) -> the answer's text.
# `extra` is the extra body ({"deterministic": True} plus, on the second ask, the seed) or None
# where the client asks through the model name; `model` is the model name to send.

def ask_httpx(base, extra, model):
    import httpx

    body = {"model": model, "messages": QUESTION, "max_tokens": MAX_TOKENS, **(extra or {})}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def ask_openai(base, extra, model):
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=MAX_TOKENS, extra_body=extra)
    return r.choices[0].message.content


def ask_openai_stream(base, extra, model):
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    chunks = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=MAX_TOKENS, stream=True,
                                            extra_body=extra)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def ask_instructor(base, extra, model):
    import instructor
    from openai import OpenAI
    from pydantic import BaseModel

    class Colour(BaseModel):
        colour: str

    client = instructor.from_openai(OpenAI(base_url=base + "/v1", api_key="x", max_retries=0))
    r = client.chat.completions.create(model=model, messages=QUESTION, response_model=Colour, max_retries=0,
                                       max_tokens=48, extra_body=extra)
    return r.colour


def ask_openai_agents(api):
    """`api`: "chat" (OpenAIChatCompletionsModel) or "responses" (OpenAIResponsesModel, the SDK's
    default model class)."""
    def ask(base, extra, model):
        from agents import OpenAIChatCompletionsModel, OpenAIResponsesModel

        model_class = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
        return _run_agent(base, extra, model, model_class)
    return ask


def _run_agent(base, extra, model, model_class):
    from agents import Agent, ModelSettings, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    llm = model_class(model=model, openai_client=AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0))
    agent = Agent(name="a", instructions="Answer briefly.", model=llm,
                  model_settings=ModelSettings(max_tokens=MAX_TOKENS, extra_body=extra))
    return Runner.run_sync(agent, PROMPT).final_output


def ask_langchain(base, extra, model):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=base + "/v1", api_key="x", model=model, max_tokens=MAX_TOKENS, max_retries=0,
                     extra_body=extra)
    return llm.invoke(PROMPT).content


def ask_langgraph(base, extra, model):
    from langchain_openai import ChatOpenAI
    from langgraph.graph import START, MessagesState, StateGraph

    llm = ChatOpenAI(base_url=base + "/v1", api_key="x", model=model, max_tokens=MAX_TOKENS, max_retries=0,
                     extra_body=extra)
    graph = StateGraph(MessagesState)
    graph.add_node("model", lambda state: {"messages": [llm.invoke(state["messages"])]})
    graph.add_edge(START, "model")
    out = graph.compile().invoke({"messages": [("user", PROMPT)]})
    return out["messages"][-1].content


def ask_litellm(base, extra, model):
    import litellm

    r = litellm.completion(model="openai/" + model, api_base=base + "/v1", api_key="x", messages=QUESTION,
                           max_tokens=MAX_TOKENS, extra_body=extra)
    return r.choices[0].message.content


def _dspy_lm(base, extra, model, max_tokens, provider="openai"):
    import dspy

    return dspy.LM(f"{provider}/{model}", api_base=base + "/v1", api_key="x", cache=False, max_tokens=max_tokens,
                   **({"extra_body": extra} if extra else {}))


def ask_dspy_lm(base, extra, model):
    """A plain `dspy.LM` call: no adapter, one request."""
    return _dspy_lm(base, extra, model, MAX_TOKENS)(PROMPT)[0]


def ask_dspy(adapter, provider="openai"):
    """`dspy.Predict("question -> answer")` with dspy's default adapter (None: ChatAdapter, which
    asks once more through JSONAdapter when it cannot parse) or with `adapter`. `provider`: the
    LiteLLM provider prefix; JSONAdapter sends a `json_schema` response_format only where
    LiteLLM says the provider supports one (`lm_studio` does, `openai` for an unknown model does not)."""
    def ask(base, extra, model):
        import dspy

        # the adapters parse "[[ ## answer ## ]]" headers or a JSON object out of the text: give the small model room
        with dspy.context(lm=_dspy_lm(base, extra, model, 64, provider), **({"adapter": adapter()} if adapter else {})):
            return dspy.Predict("question -> answer")(question=PROMPT).answer
    return ask


def _json_adapter():
    import dspy

    return dspy.JSONAdapter()


def ask_openai_responses(base, extra, model):
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    r = client.responses.create(model=model, input=PROMPT, max_output_tokens=MAX_TOKENS, extra_body=extra)
    return r.output_text


class LiteLLMProxy:
    """`litellm --config` on loopback, every model name passed through to lockstep (`openai/*`),
    started on first use; the openai client asks it."""
    proc = None
    url = None

    @classmethod
    def start(cls, base):
        if cls.proc is not None:
            return cls.url
        import httpx

        directory = Path(tempfile.mkdtemp(prefix="litellm_proxy_"))
        (directory / "config.yaml").write_text(
            'model_list:\n  - model_name: "*"\n    litellm_params:\n      model: "openai/*"\n'
            f'      api_base: "{base}/v1"\n      api_key: "x"\n')
        port = free_port()
        litellm = Path(sys.executable).with_name("litellm")
        cls.log = directory / "proxy.log"
        cls.proc = subprocess.Popen([str(litellm), "--config", str(directory / "config.yaml"), "--host", "127.0.0.1",
                                     "--port", str(port)], stdout=cls.log.open("w"), stderr=subprocess.STDOUT)
        cls.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            if cls.proc.poll() is not None:
                raise RuntimeError(f"litellm proxy exited: {cls.log.read_text()[-300:]}")
            try:
                if httpx.get(cls.url + "/health/liveliness", timeout=5).status_code == 200:
                    return cls.url
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("litellm proxy did not start")
            time.sleep(0.5)

    @classmethod
    def stop(cls):
        if cls.proc is not None:
            cls.proc.terminate()
            cls.proc.wait(timeout=60)


def ask_litellm_proxy(base, extra, model):
    return ask_openai(LiteLLMProxy.start(base), extra, model)


def ask_llama_index(base, extra, model):
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model=model, api_base=base + "/v1", api_key="x", is_chat_model=True, max_tokens=MAX_TOKENS,
                     max_retries=0, additional_kwargs={"extra_body": extra} if extra else {})
    return llm.chat([ChatMessage(role="user", content=PROMPT)]).message.content


def ask_smolagents(base, extra, model):
    from smolagents import OpenAIServerModel

    llm = OpenAIServerModel(model_id=model, api_base=base + "/v1", api_key="x", max_tokens=MAX_TOKENS,
                            **({"extra_body": extra} if extra else {}))
    return llm.generate([{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]).content


def ask_haystack(base, extra, model):
    from haystack.components.generators.chat import OpenAIChatGenerator
    from haystack.dataclasses import ChatMessage
    from haystack.utils import Secret

    gen = OpenAIChatGenerator(api_key=Secret.from_token("x"), model=model, api_base_url=base + "/v1",
                              generation_kwargs={"max_tokens": MAX_TOKENS, **({"extra_body": extra} if extra else {})})
    return gen.run(messages=[ChatMessage.from_user(PROMPT)])["replies"][0].text


def ask_autogen(base, extra, model):
    from autogen_core.models import UserMessage
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    client = OpenAIChatCompletionClient(model=model, base_url=base + "/v1", api_key="x", max_tokens=MAX_TOKENS,
                                        model_info={"vision": False, "function_calling": True, "json_output": True,
                                                    "family": "unknown", "structured_output": True})

    async def go():
        try:
            r = await client.create([UserMessage(content=PROMPT, source="user")],
                                    extra_create_args={"extra_body": extra} if extra else {})
            return r.content
        finally:
            await client.close()
    return asyncio.run(go())


def ask_outlines(base, extra, model):
    import outlines
    from openai import OpenAI

    llm = outlines.from_openai(OpenAI(base_url=base + "/v1", api_key="x", max_retries=0), model)
    return llm(PROMPT, max_tokens=MAX_TOKENS, **({"extra_body": extra} if extra else {}))


def _pydantic_ai_model(base, model):
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIChatModel(model, provider=OpenAIProvider(base_url=base + "/v1", api_key="x"))


def ask_pydantic_ai(base, extra, model):
    from pydantic_ai import Agent

    settings = {"max_tokens": MAX_TOKENS, **({"extra_body": extra} if extra else {})}
    return Agent(_pydantic_ai_model(base, model), model_settings=settings).run_sync(PROMPT).output


def ask_marvin(base, extra, model):
    import marvin
    from pydantic_ai import Agent as _  # noqa: F401 - marvin's agents are pydantic-ai agents

    # its answer is a tool call ending the task: give the small model room
    settings = {"max_tokens": 256, **({"extra_body": extra} if extra else {})}
    agent = marvin.Agent(model=_pydantic_ai_model(base, model), model_settings=settings)
    return str(marvin.run(PROMPT, agents=[agent]))


def ask_mirascope(base, extra, model):
    from mirascope import llm

    params = {"max_tokens": MAX_TOKENS}
    extra = dict(extra or {})
    if "seed" in extra:  # its own seed parameter
        params["seed"] = extra.pop("seed")
    if extra:
        params["extra_body"] = extra
    if hasattr(llm, "call") and hasattr(llm, "register_provider"):  # mirascope 2
        llm.register_provider("openai", scope="lockstep/", base_url=base + "/v1", api_key="x")

        @llm.call("lockstep/" + model, **params)
        def colour():
            return PROMPT
        return colour().text()
    from openai import OpenAI  # mirascope 1

    @llm.call(provider="openai", model=model, client=OpenAI(base_url=base + "/v1", api_key="x"),
              call_params=params)
    def colour():
        return PROMPT
    return colour().content


JS_DIR = Path(os.environ.get("CLIENTS_JS_DIR", "/work/clientenv_js"))  # the npm packages: see the docstring
JS_ASK = """
const OpenAI = require("openai");
const [base, extra, model, maxTokens, prompt] = process.argv.slice(1);
const client = new (OpenAI.OpenAI || OpenAI)({baseURL: base + "/v1", apiKey: "x", maxRetries: 0});
client.chat.completions.create({model, messages: [{role: "user", content: prompt}],
                                max_tokens: Number(maxTokens), ...JSON.parse(extra)})
  .then(r => process.stdout.write(JSON.stringify({text: r.choices[0].message.content,
                                                  seed: r.lockstep ? r.lockstep.seed : null})))
  .catch(e => { process.stderr.write(String(e)); process.exit(1); });
"""


def ask_openai_node(base, extra, model):
    """openai-node: its JSON numbers are doubles, so the seed it read is the one it sends back."""
    out = run_node(JS_ASK, base, json.dumps(extra or {}), model, str(MAX_TOKENS), PROMPT)
    return out["text"], out["seed"]


# The Vercel AI SDK: `generateText` with `@ai-sdk/openai`'s provider at its defaults (`provider(id)`
# asks /v1/responses, `provider.chat(id)` /v1/chat/completions), or with `@ai-sdk/openai-compatible`'s
# (`createOpenAICompatible`, the SDK's provider for other OpenAI-compatible servers). Its only
# way to add body fields is `providerOptions[provider name]`, which `@ai-sdk/openai` reads through
# its own schema; a seed is `generateText`'s own setting. The warnings it returned go to the note.
JS_AI_SDK = """
const {generateText} = require("ai");
const [base, extra, model, maxTokens, prompt, api] = process.argv.slice(1);
const {seed, ...fields} = JSON.parse(extra);
let llm, name;
if (api === "compatible") {
  const {createOpenAICompatible} = require("@ai-sdk/openai-compatible");
  name = "lockstep";
  llm = createOpenAICompatible({name, baseURL: base + "/v1", apiKey: "x"}).chatModel(model);
} else {
  const provider = require("@ai-sdk/openai").createOpenAI({baseURL: base + "/v1", apiKey: "x"});
  name = "openai";
  llm = api === "chat" ? provider.chat(model) : provider(model);
}
generateText({model: llm, prompt, maxRetries: 0, maxOutputTokens: Number(maxTokens), seed,
              ...(Object.keys(fields).length ? {providerOptions: {[name]: fields}} : {})})
  .then(r => process.stdout.write(JSON.stringify({text: r.text, warnings: r.warnings || []})))
  .catch(e => { process.stderr.write(String(e)); process.exit(1); });
"""

# LangChain.js: ChatOpenAI's `modelKwargs` are its extra body fields (the seed goes there too).
JS_LANGCHAIN = """
const {ChatOpenAI} = require("@langchain/openai");
const [base, extra, model, maxTokens, prompt] = process.argv.slice(1);
const llm = new ChatOpenAI({model, apiKey: "x", configuration: {baseURL: base + "/v1"}, maxTokens: Number(maxTokens),
                            maxRetries: 0, modelKwargs: JSON.parse(extra)});
llm.invoke(prompt)
  .then(r => process.stdout.write(JSON.stringify({text: r.content})))
  .catch(e => { process.stderr.write(String(e)); process.exit(1); });
"""


def ask_langchain_js(base, extra, model):
    return run_node(JS_LANGCHAIN, base, json.dumps(extra or {}), model, str(MAX_TOKENS), PROMPT)["text"]


def run_node(script: str, *args: str) -> dict:
    done = subprocess.run(["node", "-e", script, *args], cwd=JS_DIR, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "node failed")
    return json.loads(done.stdout.strip().splitlines()[-1])  # the AI SDK prints a notice before it


def ask_ai_sdk(api):
    def ask(base, extra, model):
        out = run_node(JS_AI_SDK, base, json.dumps(extra or {}), model, str(MAX_TOKENS), PROMPT, api)
        dropped = [w.get("feature") or w.get("setting") for w in out["warnings"]
                   if w.get("type") in ("unsupported", "unsupported-setting")]
        if dropped and (extra or {}).get("seed") is not None:
            # the seed never left the client: say so rather than compare an unseeded answer
            raise RuntimeError(f"the AI SDK dropped {', '.join(map(str, dropped))} (warning: unsupported)")
        return out["text"]
    return ask


def js_version(package: str = "openai") -> str:
    try:
        return json.loads((JS_DIR / "node_modules" / package / "package.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        return "not installed"


CLIENTS = [
    ("raw httpx", "httpx", "body field", ask_httpx),
    ("openai", "openai", "extra_body", ask_openai),
    ("openai (stream)", "openai", "extra_body", ask_openai_stream),
    ("openai (responses)", "openai", "extra_body", ask_openai_responses),
    ("instructor", "instructor", "extra_body", ask_instructor),
    ("openai-agents", "openai-agents", "ModelSettings(extra_body=)", ask_openai_agents("chat")),
    ("openai-agents responses (its default)", "openai-agents", "ModelSettings(extra_body=)",
     ask_openai_agents("responses")),
    ("langchain-openai", "langchain-openai", "ChatOpenAI(extra_body=)", ask_langchain),
    ("langgraph", "langgraph", "ChatOpenAI(extra_body=) in a graph node", ask_langgraph),
    ("litellm", "litellm", "extra_body", ask_litellm),
    ("litellm proxy", "litellm", "openai client's extra_body, through the proxy", ask_litellm_proxy),
    ("dspy LM call", "dspy", "LM(extra_body=)", ask_dspy_lm),
    ("dspy Predict", "dspy", "LM(extra_body=)", ask_dspy(None)),
    ("dspy Predict JSONAdapter", "dspy", "LM(extra_body=)", ask_dspy(_json_adapter)),
    ("dspy Predict lm_studio/", "dspy", "LM(extra_body=)", ask_dspy(None, "lm_studio")),
    ("dspy Predict JSONAdapter lm_studio/", "dspy", "LM(extra_body=)", ask_dspy(_json_adapter, "lm_studio")),
    ("llama-index-llms-openai-like", "llama-index-llms-openai-like", "additional_kwargs={extra_body}",
     ask_llama_index),
    ("smolagents", "smolagents", "OpenAIServerModel(extra_body=)", ask_smolagents),
    ("haystack-ai", "haystack-ai", "generation_kwargs={extra_body}", ask_haystack),
    ("autogen-ext[openai]", "autogen-ext", "extra_create_args={extra_body}", ask_autogen),
    ("outlines", "outlines", "extra_body (call kwarg)", ask_outlines),
    ("marvin", "marvin", "model_settings={extra_body} (pydantic-ai)", ask_marvin),
    ("mirascope", "mirascope", "call params extra_body", ask_mirascope),
    ("pydantic-ai", "pydantic-ai", "model_settings={extra_body}", ask_pydantic_ai),
    ("openai (node)", "npm:openai", "body field", ask_openai_node),
    ("AI SDK (node) responses (its default)", "npm:ai+@ai-sdk/openai", "providerOptions.openai",
     ask_ai_sdk("responses")),
    ("AI SDK (node) .chat", "npm:ai+@ai-sdk/openai", "providerOptions.openai", ask_ai_sdk("chat")),
    ("AI SDK (node) openai-compatible", "npm:ai+@ai-sdk/openai-compatible", "providerOptions.lockstep",
     ask_ai_sdk("compatible")),
    ("langchain (node)", "npm:@langchain/openai", "modelKwargs", ask_langchain_js),
]
SUFFIX = "default:deterministic"


class Recording:
    def __init__(self, directory: Path):
        self.path = directory / "requests.jsonl"
        self.seen = 0

    def new(self, settle: float = 2.0) -> list[dict]:
        """Lines written since the last call (a stream's line is written as it ends: wait a little)."""
        deadline = time.monotonic() + settle
        while True:
            lines = self.path.read_text().splitlines() if self.path.exists() else []
            if len(lines) > self.seen or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        fresh = [json.loads(x) for x in lines[self.seen:]]
        self.seen = len(lines)
        return fresh


def attempt(base, rec, ask, extra, model):
    """(text, the recorded lines, error)."""
    try:
        text = ask(base, extra, model)
        return text, rec.new(), None
    except Exception as exc:  # noqa: BLE001 - a client's failure is a row of the table
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()[-1]
        return None, rec.new(), detail[:160]


def answer_of(lines):
    """What must match between the two asks: per recorded request, per choice, the token ids and
    the receipt's answer and logprobs digests."""
    return [[(c["token_ids"], (c["receipt"] or {}).get("answer"), (c["receipt"] or {}).get("logprobs"))
             for c in line["choices"]] for line in lines]


def check(name, ask, how, base, rec):
    extra = None if how == "model name" else {"deterministic": True}
    model = SUFFIX if extra is None else "default"
    text, lines, error = attempt(base, rec, ask, extra, model)
    if error and extra is not None and not lines:
        return check(name, ask, "model name", base, rec)
    row = {"how": how if extra is not None else f"model `{SUFFIX}`", "requests": len(lines)}
    if error and not lines:
        row.update(status="no request reached the server", guaranteed="-", reproduced="-", note=error)
        return row
    receipts = [c["receipt"] or {} for line in lines for c in line["choices"]]
    deterministic = bool(receipts) and all(r.get("deterministic") for r in receipts)
    guaranteed = bool(receipts) and all(r.get("guaranteed") for r in receipts)
    seeds = [r.get("seed") for r in receipts]
    # a client that failed after its request was answered (its parser, say): the server's side still counts
    status = "200" if not error else f"200, then the client failed: {error}"
    row.update(status=status if lines else "no request recorded", deterministic=deterministic,
               guaranteed=guaranteed, seed=seeds[0] if seeds else None)
    if not deterministic and extra is not None:
        # the extra field was dropped on the way: ask through the model name instead
        again = check(name, ask, "model name", base, rec)
        again["note"] = f"{how} did not arrive (not deterministic); " + again.get("note", "")
        return again
    seed = seeds[0] if seeds else None
    if isinstance(text, tuple):  # (text, the seed as the client itself read it)
        text, seed = text
    if extra is not None:
        extra2 = {**extra, **({"seed": seed} if seed is not None else {})}
        text2, lines2, error2 = attempt(base, rec, ask, extra2, model)
    else:
        text2, lines2, error2 = attempt(base, rec, ask_with_seed(ask, seed), None, model)
    # One seed goes with every request of a client call: where a client sent several (a parse
    # retry with another adapter, say), the later ones drew seeds of their own the first time,
    # so only the first request is compared and the text only for a single request.
    if isinstance(text2, tuple):
        text2 = text2[0]
    if prompts_of(lines[:1]) != prompts_of(lines2[:1]):
        # the client wrote another prompt the second time (ids or names drawn per call): asking
        # again tests nothing; the recorded request, sent again by `lockstep replay`, does
        outcome = replay_first(base, lines[0])
        rec.new()  # the replayed request's own line: not the next client's
        row.update(reproduced=f"by replay: {outcome}" if outcome != "identical" else "by replay",
                   note=f"{len(lines)} request(s), seed {seed}; asked again, the client sent another prompt "
                        f"(the receipts' prompt digests differ); `lockstep replay` of the first recorded "
                        f"request: {outcome}" + (f"; again: {error2}" if error2 and error2 != error else ""))
        return row
    same_tokens = answer_of(lines[:1]) == answer_of(lines2[:1])
    same_text = len(lines) > 1 or (text == text2 and error == error2)
    replayed = ""
    if not (same_tokens and same_text):  # the client's doing or the server's? the recorded request says
        replayed = f"; `lockstep replay` of the first recorded request: {replay_first(base, lines[0])}"
        rec.new()
    row.update(reproduced=same_tokens and same_text,
               note=f"{len(lines)} request(s), seed {seed}; first request's tokens "
                    f"{'same' if same_tokens else 'differ'}, "
                    + ("text not compared" if len(lines) > 1 else f"text {'same' if same_text else 'differs'}")
                    + (f"; again: {error2}" if error2 and error2 != error else "") + replayed)
    return row


def prompts_of(lines):
    return [[(c["receipt"] or {}).get("prompt") for c in line["choices"]] for line in lines]


LOCKSTEP = str(ROOT / ".venv/bin/lockstep")


def replay_first(base, line) -> str:
    """`lockstep replay --url` of one recorded request: its verdicts, or why it failed."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "one.jsonl"
        path.write_text(json.dumps(line) + "\n")
        done = subprocess.run([LOCKSTEP, "replay", str(path), "--url", base, "--json"], capture_output=True,
                              text=True, timeout=600)
    try:
        outcomes = {v["outcome"] for v in json.loads(done.stdout)}
    except ValueError:
        return f"replay failed ({done.returncode}): {done.stderr.strip()[-200:]}"
    return ", ".join(sorted(outcomes))


def ask_with_seed(ask, seed):
    """A client asking through the model name has no extra body: it sends the seed itself
    (only the clients that fall back to the model name need this)."""
    if seed is None:
        return ask

    def seeded(base, extra, model):
        return ask(base, {"seed": seed}, model)
    return seeded


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lockstep", default=str(ROOT / ".venv/bin/lockstep"))
    parser.add_argument("--only", help="comma-separated client names")
    parser.add_argument("serve", nargs="*")
    args = parser.parse_args()
    global LOCKSTEP
    LOCKSTEP = args.lockstep
    serve = args.serve or ["--batch-invariant-limit", "4"]
    directory = Path(tempfile.mkdtemp(prefix="clients_deterministic_"))
    port = free_port()
    log = (directory / "serve.log").open("w")
    proc = subprocess.Popen([args.lockstep, "serve", "--port", str(port), *serve, "--record", str(directory)],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        import httpx

        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"lockstep serve exited: see {directory}/serve.log")
            try:
                health = httpx.get(base + "/health").json()
                if health.get("guarantee") != "proving" and not health.get("starting"):
                    break
            except (httpx.TransportError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise SystemExit("lockstep serve did not start")
            time.sleep(0.5)
        rec = Recording(directory)
        rows = []
        only = set(args.only.split(",")) if args.only else None
        for name, dist, how, ask in CLIENTS:
            if only and name not in only:
                continue
            if version(dist) == "not installed":
                rows.append((name, "not installed", how, "-", "-", "-", ""))
                continue
            row = check(name, ask, how, base, rec)
            rows.append((name, version(dist), row["how"], row["status"], row.get("guaranteed", "-"),
                         row.get("reproduced", "-"), row.get("note", "")))
            print(" | ".join(str(x) for x in rows[-1]), flush=True)
    finally:
        LiteLLMProxy.stop()
        proc.terminate()
        proc.wait(timeout=120)
    print("\n| client | version | how deterministic was asked | status | guaranteed | reproduced | note |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
