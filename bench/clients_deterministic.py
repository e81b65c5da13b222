"""Issue 57: do the clients people use get deterministic answers from lockstep at their defaults?

    python3 -m venv /work/clientenv && /work/clientenv/bin/pip install openai httpx instructor \
        openai-agents langchain-openai langgraph litellm dspy llama-index-llms-openai-like smolagents \
        haystack-ai autogen-agentchat 'autogen-ext[openai]' outlines marvin mirascope pydantic-ai
    /work/clientenv/bin/python bench/clients_deterministic.py [--lockstep .venv/bin/lockstep] \
        [-- serve args, default: --batch-invariant-limit 4]

(run with the clients' own venv, never the project's: it starts `lockstep serve` from
`--lockstep`). One server of the embedded model with `--record DIR`. Each client is used at
its defaults (its own default temperature and so on) with only `deterministic: true` added
through its own extra-body mechanism, or, where it has none, the model name
`default:deterministic`. What the server did is read from the recording (a client may drop
the response's `lockstep` object): the request's status, whether the guarantee covered every
answer (`receipt.guaranteed`), and the seed (drawn by the server when the client sent none).
Then the same client asks again with that seed (through the same mechanism, or its own seed
setting), and the answer must be the same: the token ids and the receipt's `answer` and
`logprobs` digests recorded for both, and the text the client returned.

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
    if dist.startswith("npm:"):
        return js_version()
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


def ask_openai_agents(base, extra, model):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    llm = OpenAIChatCompletionsModel(model=model, openai_client=AsyncOpenAI(base_url=base + "/v1", api_key="x",
                                                                           max_retries=0))
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


def ask_dspy(base, extra, model):
    import dspy

    # its adapter parses "[[ ## answer ## ]]" fields out of the text: give the small model room
    lm = dspy.LM("openai/" + model, api_base=base + "/v1", api_key="x", cache=False, max_tokens=64,
                 **({"extra_body": extra} if extra else {}))
    with dspy.context(lm=lm):
        return dspy.Predict("question -> answer")(question=PROMPT).answer


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

    settings = {"max_tokens": MAX_TOKENS, **({"extra_body": extra} if extra else {})}
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


JS_DIR = Path(os.environ.get("CLIENTS_JS_DIR", "/work/clientenv_js"))  # `npm install openai` there
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
    done = subprocess.run(["node", "-e", JS_ASK, base, json.dumps(extra or {}), model, str(MAX_TOKENS), PROMPT],
                          cwd=JS_DIR, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "node failed")
    out = json.loads(done.stdout)
    return out["text"], out["seed"]


def js_version() -> str:
    try:
        return json.loads((JS_DIR / "node_modules/openai/package.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        return "not installed"


CLIENTS = [
    ("raw httpx", "httpx", "body field", ask_httpx),
    ("openai", "openai", "extra_body", ask_openai),
    ("openai (stream)", "openai", "extra_body", ask_openai_stream),
    ("instructor", "instructor", "extra_body", ask_instructor),
    ("openai-agents", "openai-agents", "ModelSettings(extra_body=)", ask_openai_agents),
    ("langchain-openai", "langchain-openai", "ChatOpenAI(extra_body=)", ask_langchain),
    ("langgraph", "langgraph", "ChatOpenAI(extra_body=) in a graph node", ask_langgraph),
    ("litellm", "litellm", "extra_body", ask_litellm),
    ("dspy", "dspy", "LM(extra_body=)", ask_dspy),
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
    same_tokens = answer_of(lines[:1]) == answer_of(lines2[:1])
    same_text = len(lines) > 1 or (text == text2 and error == error2)
    row.update(reproduced=same_tokens and same_text,
               note=f"{len(lines)} request(s), seed {seed}; first request's tokens "
                    f"{'same' if same_tokens else 'differ'}, "
                    + ("text not compared" if len(lines) > 1 else f"text {'same' if same_text else 'differs'}")
                    + (f"; again: {error2}" if error2 and error2 != error else ""))
    return row


def ask_with_seed(ask, seed):
    """A client asking through the model name has no extra body: it sends the seed itself
    (only the clients that fall back to the model name need this)."""
    if seed is None:
        return ask

    def seeded(base, extra, model):
        return ask(base, {"seed": seed}, model)
    return seeded


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lockstep", default=str(ROOT / ".venv/bin/lockstep"))
    parser.add_argument("--only", help="comma-separated client names")
    parser.add_argument("serve", nargs="*")
    args = parser.parse_args()
    serve = args.serve or ["--batch-invariant-limit", "4"]
    directory = Path(tempfile.mkdtemp(prefix="clients_deterministic_"))
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
        proc.terminate()
        proc.wait(timeout=120)
    print("\n| client | version | how deterministic was asked | status | guaranteed | reproduced | note |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
