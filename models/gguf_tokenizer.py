"""GGUF vocabulary → Hugging Face `tokenizer.json` + `tokenizer_config.json`.

Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is supported. The pre-tokenizer
follows `tokenizer.ggml.pre`, matching what llama.cpp does for that name and what the
original HF tokenizer.json contains.
"""
import json
from pathlib import Path

from tokenizers import Tokenizer

from lockstep.models.errors import ModelError

# llama.cpp token types (llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

BYTE_LEVEL_REGEX = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
BYTE_LEVEL_PLAIN = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre → HF pre_tokenizer. llama.cpp's "smollm"/"starcoder" split every
# digit on its own and then apply the GPT-2 regex, which is HF's Digits + ByteLevel.
_DIGITS_THEN_GPT2 = {
    "type": "Sequence",
    "pretokenizers": [{"type": "Digits", "individual_digits": True}, BYTE_LEVEL_REGEX],
}
PRE_TOKENIZERS = {
    "default": BYTE_LEVEL_REGEX,
    "gpt-2": BYTE_LEVEL_REGEX,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "llama-bpe": {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_REGEX}, "behavior": "Isolated", "invert": False},
            BYTE_LEVEL_PLAIN,
        ],
    },
}

# Control tokens that end a turn in common chat templates; those present become eos ids.
END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>",
    "<|end|>", "<end_of_turn>", "</s>",
)


class GGUFVocab:
    """The tokenizer fields of one GGUF file, read once."""

    def __init__(self, meta: dict, source: Path):
        self.source = source
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ModelError(
                f"{source}: tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2')"
            )
        self.pre = meta.get("tokenizer.ggml.pre") or "default"
        if self.pre not in PRE_TOKENIZERS:
            raise ModelError(
                f"{source}: pre-tokenizer {self.pre!r} is not supported "
                f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
            )
        self.tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        self.types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(self.tokens))
        self.merges: list[str] = list(meta.get("tokenizer.ggml.merges") or [])
        self.bos_id = meta.get("tokenizer.ggml.bos_token_id")
        self.eos_id = meta.get("tokenizer.ggml.eos_token_id")
        self.unk_id = meta.get("tokenizer.ggml.unknown_token_id")
        self.pad_id = meta.get("tokenizer.ggml.padding_token_id")
        self.eot_ids = [meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta]
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        self.add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        self.chat_template = meta.get("tokenizer.chat_template")

    def token(self, token_id) -> str | None:
        if token_id is None or not 0 <= token_id < len(self.tokens):
            return None
        return self.tokens[token_id]

    def eos_token_ids(self) -> list[int]:
        """GGUF eos, its eot/eom ids, then every end-of-turn control token present."""
        ids = [i for i in [self.eos_id, *self.eot_ids] if self.token(i) is not None]
        control = {t: i for i, (t, ty) in enumerate(zip(self.tokens, self.types)) if ty == CONTROL}
        ids += [control[t] for t in END_OF_TURN_TOKENS if t in control]
        return list(dict.fromkeys(ids))

    def tokenizer_json(self) -> dict:
        vocab: dict[str, int] = {}
        for i, tok in enumerate(self.tokens):
            vocab.setdefault(tok, i)  # first id wins if a GGUF repeats a string
        merges = [m.split(" ", 1) for m in self.merges]
        added = [
            {
                "id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": ty == CONTROL,
            }
            for i, (tok, ty) in enumerate(zip(self.tokens, self.types))
            if ty in (CONTROL, USER_DEFINED)
        ]
        return {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": PRE_TOKENIZERS[self.pre],
            "post_processor": self._post_processor(),
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {
                "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                "ignore_merges": False, "vocab": vocab, "merges": merges,
            },
        }

    def _post_processor(self) -> dict:
        # Chat templates already write their special tokens; only add bos/eos when the
        # GGUF says the model expects them on every encode.
        bos, eos = self.token(self.bos_id), self.token(self.eos_id)
        head = [{"SpecialToken": {"id": bos, "type_id": 0}}] if self.add_bos and bos else []
        tail = [{"SpecialToken": {"id": eos, "type_id": 0}}] if self.add_eos and eos else []
        if not head and not tail:
            return {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
        seq = lambda t: {"Sequence": {"id": t, "type_id": 0}}  # noqa: E731
        used = ([(bos, self.bos_id)] if head else []) + ([(eos, self.eos_id)] if tail else [])
        specials = {t: {"id": t, "ids": [i], "tokens": [t]} for t, i in used}
        return {
            "type": "TemplateProcessing",
            "single": [*head, seq("A"), *tail],
            "pair": [*head, seq("A"), *tail, *head, seq("B"), *tail],
            "special_tokens": specials,
        }

    def tokenizer_config(self, context_length: int) -> dict:
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos,
            "add_eos_token": self.add_eos,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": context_length,
            "bos_token": self.token(self.bos_id),
            "eos_token": self.token(self.eos_id),
            "unk_token": self.token(self.unk_id),
            "pad_token": self.token(self.pad_id),
        }
        if self.chat_template:
            config["chat_template"] = self.chat_template
        return {k: v for k, v in config.items() if v is not None}


def write_tokenizer(vocab: GGUFVocab, out_dir: Path, context_length: int) -> None:
    """Write tokenizer.json (validated by loading it) and tokenizer_config.json."""
    text = json.dumps(vocab.tokenizer_json(), ensure_ascii=False)
    try:
        Tokenizer.from_str(text)
    except Exception as exc:  # the tokenizers library rejects a malformed vocab/merges
        raise ModelError(f"{vocab.source}: cannot build a tokenizer from its vocabulary: {exc}") from exc
    (out_dir / "tokenizer.json").write_text(text, encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(vocab.tokenizer_config(context_length), indent=2, ensure_ascii=False), encoding="utf-8"
    )
