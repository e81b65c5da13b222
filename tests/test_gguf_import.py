"""GGUF import: exact re-encoding of quantized tensors, Q/K un-permutation, tokenizer,
config, caching; on a tiny synthetic llama GGUF and on the embedded SmolLM2 file."""
import json
import math

import mlx.core as mx
import numpy as np
import pytest
import regex
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter, quants

from lockstep.models.embedded import embedded_gguf_path
from lockstep.models.gguf_import import import_gguf
from lockstep.models.gguf_tensors import NATIVE_BITS, native_affine, unpermute_rope_rows

# ---- a tiny llama GGUF, written the way llama.cpp's converter would ---------------------

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, CTX = 64, 4, 2, 96, 2, 512
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "l l", "o r", "Ġ w", "Ġw or", "l d", "Ġwor ld", "Ġ 1"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table (independent of the code under test)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tiny_vocab() -> list[str]:
    tokens = SPECIALS + list(bytes_to_unicode().values())
    tokens += ["".join(m.split(" ")) for m in MERGES]
    return tokens


def hf_to_gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, copied: the layout llama.cpp stores."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, arch: str = "llama", seed: int = 0) -> dict[str, np.ndarray]:
    """Write a small llama GGUF; return the HF-layout float weights it was made from."""
    rng = np.random.default_rng(seed)
    tokens = tiny_vocab()
    w = GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(CTX)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(1)  # like the brief's SmolLM2 note: bos = eos = <|im_start|>
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    hf = {}

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)

    def put(name, arr, qtype=QT.F32):
        if qtype in (QT.Q4_1, QT.Q8_0):
            w.add_tensor(name, quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, arr.astype(np.float16 if qtype == QT.F16 else np.float32))

    hf["model.embed_tokens.weight"] = mat(len(tokens), HIDDEN)
    put("token_embd.weight", hf["model.embed_tokens.weight"], QT.Q8_0)
    for i in range(LAYERS):
        q4_or_f32 = QT.F32 if i == 0 else QT.Q4_1  # layer 0 keeps Q/K exact to check un-permutation
        for gname, hname, rows, cols, qt, heads in [
            ("attn_q", "self_attn.q_proj", HIDDEN, HIDDEN, q4_or_f32, HEADS),
            ("attn_k", "self_attn.k_proj", KV_HEADS * HEAD_DIM, HIDDEN, q4_or_f32, KV_HEADS),
            ("attn_v", "self_attn.v_proj", KV_HEADS * HEAD_DIM, HIDDEN, QT.F16 if i == 0 else QT.Q4_1, None),
            ("attn_output", "self_attn.o_proj", HIDDEN, HIDDEN, QT.Q4_1, None),
            ("ffn_gate", "mlp.gate_proj", FFN, HIDDEN, QT.Q4_1, None),
            ("ffn_up", "mlp.up_proj", FFN, HIDDEN, QT.Q4_1, None),
            ("ffn_down", "mlp.down_proj", HIDDEN, FFN, QT.Q4_1, None),
        ]:
            a = mat(rows, cols)
            hf[f"model.layers.{i}.{hname}.weight"] = a
            put(f"blk.{i}.{gname}.weight", hf_to_gguf_permute(a, heads) if heads else a, qt)
        for gname, hname in [("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")]:
            hf[f"model.layers.{i}.{hname}.weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
            put(f"blk.{i}.{gname}.weight", hf[f"model.layers.{i}.{hname}.weight"])
    hf["model.norm.weight"] = np.ones(HIDDEN, np.float32)
    put("output_norm.weight", hf["model.norm.weight"])

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    gguf_path = root / "tiny-llama.gguf"
    hf = write_tiny_gguf(gguf_path)
    cache = root / "cache"
    dirs = {fmt: import_gguf(gguf_path, fmt, cache_root=cache, progress=False) for fmt in ("q4", "float32")}
    return {"gguf": gguf_path, "hf": hf, "cache": cache, **dirs}


def dequant(weights: dict, base: str, bits: int) -> np.ndarray:
    return np.array(
        mx.dequantize(weights[f"{base}.weight"], weights[f"{base}.scales"], weights[f"{base}.biases"], group_size=32, bits=bits)
    )


# ---- tensor re-encoding ---------------------------------------------------------------

@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q8_0])
def test_native_affine_dequantizes_bit_identical_to_gguf(qtype):
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((48, 160)) * rng.uniform(0.01, 3, (48, 1))).astype(np.float32)
    w[3, :32] = 0.5  # a constant block (d = 0) must survive too
    raw = quants.quantize(w, qtype)
    arrays = native_affine(raw, qtype, w.shape[1])
    assert arrays["scales"].dtype == np.float32 and arrays["biases"].dtype == np.float32
    assert arrays["weight"].dtype == np.uint32
    ours = np.array(mx.dequantize(*(mx.array(arrays[k]) for k in ("weight", "scales", "biases")), group_size=32, bits=NATIVE_BITS[qtype]))
    reference = quants.dequantize(raw, qtype)
    assert ours.view(np.uint32).tolist() == reference.view(np.uint32).tolist()


def test_unpermute_inverts_llama_cpp_permutation_on_rows_and_packed_data():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((8 * 16, 64)).astype(np.float32)
    for heads in (8, 4, 2):
        assert np.array_equal(unpermute_rope_rows(hf_to_gguf_permute(w, heads), heads), w)
        assert not np.array_equal(hf_to_gguf_permute(w, heads), w)
    # Rows move whole, so permuting quantized blocks equals quantizing permuted rows.
    packed = native_affine(quants.quantize(hf_to_gguf_permute(w, 8), QT.Q4_1), QT.Q4_1, 64)
    direct = native_affine(quants.quantize(w, QT.Q4_1), QT.Q4_1, 64)
    for key in ("weight", "scales", "biases"):
        assert np.array_equal(unpermute_rope_rows(packed[key], 8), direct[key])


# ---- the tiny GGUF --------------------------------------------------------------------

def test_tiny_config(tiny):
    config = json.loads((tiny["q4"] / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (HIDDEN, LAYERS, FFN)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (HEADS, KV_HEADS)
    assert config["vocab_size"] == len(tiny_vocab())
    assert config["max_position_embeddings"] == CTX
    assert config["tie_word_embeddings"] is True
    assert math.isclose(config["rms_norm_eps"], 1e-5, rel_tol=1e-6) and config["rope_theta"] == 10000.0
    im_end, im_start, eot = (tiny_vocab().index(t) for t in ("<|im_end|>", "<|im_start|>", "<|endoftext|>"))
    assert im_end in config["eos_token_id"] and eot in config["eos_token_id"] and im_start in config["eos_token_id"]
    generation = json.loads((tiny["q4"] / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]
    quant = config["quantization"]
    assert quant["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    assert quant["model.layers.1.self_attn.q_proj"] == {"group_size": 32, "bits": 4}
    assert quant["model.layers.0.self_attn.q_proj"] is False  # F32 in the file: stays float
    assert "quantization" not in json.loads((tiny["float32"] / "config.json").read_text())


def test_tiny_q4_weights_equal_gguf_dequantization(tiny):
    from gguf import GGUFReader

    weights = mx.load(str(tiny["q4"] / "model.safetensors"))
    assert all(weights[k].dtype == mx.float32 for k in weights if k.endswith((".scales", ".biases")))
    reader = GGUFReader(tiny["gguf"])
    checked = 0
    for t in reader.tensors:
        if t.tensor_type not in NATIVE_BITS or ".attn_q." in t.name or ".attn_k." in t.name:
            continue
        base = {"token_embd.weight": "model.embed_tokens"}.get(t.name)
        if base is None:
            layer, gname = t.name.split(".")[1:3]
            base = {
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
                "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
            }[gname]
            base = f"model.layers.{layer}.{base}"
        ours = dequant(weights, base, NATIVE_BITS[t.tensor_type])
        reference = quants.dequantize(t.data, t.tensor_type)
        assert ours.view(np.uint32).tolist() == reference.view(np.uint32).tolist(), t.name
        checked += 1
    assert checked == 1 + 5 + 4  # embedding, layer 1 v/o/gate/up/down, layer 0 o/gate/up/down


def test_tiny_qk_rows_come_back_in_hf_order(tiny):
    hf = tiny["hf"]
    f32 = mx.load(str(tiny["float32"] / "model.safetensors"))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        assert np.array_equal(np.array(f32[name]), hf[name])  # F32 in the GGUF: exact
    q4 = mx.load(str(tiny["q4"] / "model.safetensors"))
    for base in ("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"):
        expected = quants.dequantize(quants.quantize(hf[f"{base}.weight"], QT.Q4_1), QT.Q4_1)
        assert np.array_equal(dequant(q4, base, 4), expected)
        # and the float32 import of the same tensor agrees
        assert np.array_equal(np.array(f32[f"{base}.weight"]), expected)


def test_tiny_imports_are_cached_atomically(tiny):
    config = tiny["q4"] / "config.json"
    before = config.stat().st_mtime_ns
    assert import_gguf(tiny["gguf"], "q4", cache_root=tiny["cache"], progress=False) == tiny["q4"]
    assert config.stat().st_mtime_ns == before
    assert sorted(p.name for p in tiny["cache"].iterdir()) == sorted([tiny["q4"].name, tiny["float32"].name])


# ---- reference byte-level BPE, to check the generated tokenizer against ---------------

GPT2_SPLIT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def reference_encode(text: str, vocab: dict[str, int], merges: list[str], specials: list[str]) -> list[int]:
    """llama.cpp 'smollm' pre-tokenization (each digit alone, then the GPT-2 regex) + BPE."""
    ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
    to_char = bytes_to_unicode()
    ids = []
    for part in regex.split("(" + "|".join(map(regex.escape, specials)) + ")", text):
        if part in specials:
            ids.append(vocab[part])
            continue
        for chunk in regex.split(r"(\p{N})", part):
            for word in GPT2_SPLIT.findall(chunk):
                symbols = [to_char[b] for b in word.encode("utf-8")]
                while len(symbols) > 1:
                    rank, i = min((ranks.get(pair, math.inf), i) for i, pair in enumerate(zip(symbols, symbols[1:])))
                    if rank == math.inf:
                        break
                    symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
                ids += [vocab[s] for s in symbols]
    return ids


SAMPLES = [
    "Hello world",
    "the weather in the world",
    "  two leading spaces and trailing  ",
    "tabs\tand\nnewlines\n\n  indented",
    "Numbers 12345 and 3.14, 1,000,000 and x2y",
    "I'm sure they'll say it's fine; don't you?",
    "Café naïve 你好 😀 ü",
    "def f(x):\n    return x ** 2  # note",
]


def load_tokenizer(path):
    from mlx_lm.tokenizer_utils import load as load_tok

    return load_tok(path)


def test_tiny_tokenizer_matches_reference_and_round_trips(tiny):
    tok = load_tokenizer(tiny["q4"])
    vocab = {t: i for i, t in enumerate(tiny_vocab())}
    for text in SAMPLES:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == reference_encode(text, vocab, MERGES, SPECIALS), text
        assert tok.decode(ids) == text
    assert tok.encode(" the", add_special_tokens=False) == [vocab["Ġthe"]]
    assert tok.encode("12", add_special_tokens=False) == [vocab["1"], vocab["2"]]  # digits split


def test_tiny_chat_template_encodes_specials_once(tiny):
    tok = load_tokenizer(tiny["q4"])
    prompt = tok.apply_chat_template([{"role": "user", "content": "the world 42"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nthe world 42<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "the world 42"}], add_generation_prompt=True)
    vocab = {t: i for i, t in enumerate(tiny_vocab())}
    assert ids == reference_encode(prompt, vocab, MERGES, SPECIALS)
    assert ids[0] == vocab["<|im_start|>"] and ids[1] != vocab["<|im_start|>"]  # no doubled bos
    config = json.loads((tiny["q4"] / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE and config["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_tiny_model_loads_and_runs_in_mlx_lm(tiny):
    from mlx_lm import generate
    from mlx_lm.utils import load

    logits = {}
    for fmt in ("q4", "float32"):
        model, tok = load(str(tiny[fmt]))
        ids = tok.encode("the world", add_special_tokens=False)
        out = model(mx.array([ids]))
        assert out.shape == (1, len(ids), len(tiny_vocab()))
        logits[fmt] = np.array(out.astype(mx.float32))
        assert np.isfinite(logits[fmt]).all()
        assert isinstance(generate(model, tok, ids, max_tokens=3), str)
    # Same weights in two encodings: only arithmetic order differs.
    np.testing.assert_allclose(logits["q4"], logits["float32"], atol=1e-4)


# ---- the embedded SmolLM2 GGUF --------------------------------------------------------

@pytest.fixture(scope="module")
def embedded_vocab():
    from gguf import GGUFReader

    reader = GGUFReader(embedded_gguf_path())
    field = lambda k: reader.fields[k].contents()  # noqa: E731
    tokens, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
    return {
        "vocab": {t: i for i, t in enumerate(tokens)},
        "merges": field("tokenizer.ggml.merges"),
        "specials": [t for t, ty in zip(tokens, types) if ty == 3],
    }


def test_embedded_import_config(embedded_model):
    config = json.loads((embedded_model.path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["vocab_size"] == 49152 and config["max_position_embeddings"] == 8192
    assert config["tie_word_embeddings"] is True
    im_end = embedded_model.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in config["eos_token_id"] and im_end in embedded_model.eos_token_ids
    tokenizer_json = json.loads((embedded_model.path / "tokenizer.json").read_text())
    # What HF's SmolLM2 tokenizer.json has: digits one by one, then GPT-2 byte level.
    assert tokenizer_json["pre_tokenizer"] == {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        ],
    }
    assert tokenizer_json["normalizer"] is None


def test_embedded_tokenizer_parity(embedded_model, embedded_vocab):
    tok = embedded_model.tokenizer
    for text in SAMPLES:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == reference_encode(text, **embedded_vocab), text
        assert tok.decode(ids) == text
    messages = [{"role": "user", "content": "What is 12+30?\nAnswer  in one line."}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert ids == reference_encode(prompt, **embedded_vocab)
    im_start = embedded_vocab["vocab"]["<|im_start|>"]
    assert ids[0] == im_start and ids[1] != im_start  # template writes the special tokens, no extra bos
    assert ids.count(im_start) == prompt.count("<|im_start|>")


def test_embedded_answers_capital_of_france(embedded_model):
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    tok = embedded_model.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    answer = generate(embedded_model.model, tok, ids, max_tokens=20, sampler=make_sampler(temp=0.0))
    assert "Paris" in answer


def test_a_start_from_the_cached_import_reads_no_gguf(embedded_model, tmp_path):
    """Issue 54 (a restart's imports): a model already imported is loaded without the `gguf`
    package (its reader and dequantizers are imported by an import only)."""
    import subprocess
    import sys

    weights = json.loads((embedded_model.path / "config.json").read_text())["lockstep"]["weights"]
    code = ("import sys; from lockstep.models.load import load_model; "
            f"load_model('default', weights={weights!r}); "
            "print(sorted(m for m in sys.modules if m == 'gguf' or m.startswith(('gguf.', 'lockstep.models.gguf_t'))))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "['lockstep.models.gguf_tokenizer']"
