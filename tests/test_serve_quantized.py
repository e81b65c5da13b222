"""`serve --quantize nvfp4` end to end: load, quantize, audit (with its workaround), serve.

The synthetic llama has hidden size 1040 (≡ 16 mod 32): on MLX's CPU backend its nvfp4
embedding lookup of an odd number of rows fails, so the server only answers because the
audit patched that path. The openai client must get a completion and /v1/models must
report the workaround.
"""
import pytest
from openai import OpenAI

from tests.http_server import running
from tests.synthetic import build_llama_dir, write_tiny_tokenizer

from lockstep.server.api.app import create_app
from lockstep.server.engine import Engine
from lockstep.server.runtime import Options, build_runtime


@pytest.fixture(scope="module")
def float_1040_dir(tmp_path_factory):
    path = build_llama_dir(tmp_path_factory.mktemp("llama1040"))  # float32, quantized at load
    write_tiny_tokenizer(path)
    return path


def serve_and_ask(runtime, prompt: str) -> tuple[str, dict]:
    engine = Engine(runtime.loaded, deployment=runtime.deployment).start()
    try:
        app = create_app(engine, model_extras=runtime.model_info(),
                         fingerprint=runtime.deployment.fingerprint)
        with running(app) as url:
            client = OpenAI(base_url=f"{url}/v1", api_key="x")
            reply = client.completions.create(model="default", prompt=prompt, max_tokens=3,
                                              temperature=0)
            served = client.models.list().data[0]
    finally:
        engine.stop()
    return reply.choices[0].text, served.model_extra["lockstep"]


def test_quantize_nvfp4_at_load_serves_the_1040_wide_model(float_1040_dir):
    runtime = build_runtime(Options(model=str(float_1040_dir), quantize="nvfp4"))
    text, info = serve_and_ask(runtime, "w5 w6 w7")  # 3 tokens: an odd-row lookup
    assert isinstance(text, str) and text.strip()
    assert info["audit"]["workarounds"], "the CPU odd-row nvfp4 lookup failure must be patched"
    assert all(v == "pad32" for v in info["audit"]["workarounds"].values())
    assert info["transform"].startswith("quantize=nvfp4")


def test_quantize_nvfp4_at_load_serves_the_embedded_model():
    runtime = build_runtime(Options(model="default", quantize="nvfp4"))
    text, info = serve_and_ask(runtime, "The capital of France is")
    assert text.strip()
    assert info["audit"]["refused"] == []
    assert info["audit"]["configurations"] >= 1
