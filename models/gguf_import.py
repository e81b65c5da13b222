"""GGUF file → cached mlx-lm model directory (config.json, model.safetensors, tokenizer).

Architectures are a table (`ARCHITECTURES`): each entry turns GGUF metadata into an
mlx-lm config and GGUF tensor names into HF/mlx-lm names. Only llama is there so far;
anything else is refused with the file and the architecture named.
"""
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from lockstep.models import cache_dir
from lockstep.models.errors import ModelError
from lockstep.models.gguf_tokenizer import GGUFVocab, write_tokenizer

log = logging.getLogger(__name__)

WEIGHT_FORMATS = ("q4", "float32", "float16")
# Bump when the produced directory changes, so stale caches are not reused.
IMPORT_FORMAT_VERSION = 1


@dataclass(frozen=True)
class Architecture:
    config: Callable[[dict, "GGUFFile"], dict]   # GGUF metadata → mlx-lm config.json
    tensor_name: Callable[[str], str | None]     # GGUF tensor name → HF name (None: unknown)
    rope_heads: Callable[[str, dict], int | None]  # heads to un-permute a Q/K weight by


# ---- llama ---------------------------------------------------------------------------

_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LLAMA_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _llama_tensor_name(name: str) -> str | None:
    if name in _LLAMA_GLOBAL:
        return _LLAMA_GLOBAL[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LLAMA_LAYER and parts[3] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{_LLAMA_LAYER[parts[2]]}.{parts[3]}"
    return None


def _llama_rope_heads(name: str, config: dict) -> int | None:
    if ".attn_q." in name:
        return config["num_attention_heads"]
    if ".attn_k." in name:
        return config["num_key_value_heads"]
    return None


def _llama_config(meta: dict, gguf: "GGUFFile") -> dict:
    arch = "llama"

    def need(key):
        if f"{arch}.{key}" not in meta:
            raise ModelError(f"{gguf.path}: GGUF metadata lacks {arch}.{key}")
        return meta[f"{arch}.{key}"]

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rope_dims = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelError(f"{gguf.path}: partial RoPE ({rope_dims} of {head_dim} dims) is not supported")
    if "rope_freqs.weight" in gguf.tensor_names:
        raise ModelError(f"{gguf.path}: per-frequency RoPE scaling (rope_freqs, llama 3.1+) is not supported yet")
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(need("block_count")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "vocab_size": int(meta.get(f"{arch}.vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        "max_position_embeddings": int(need("context_length")),
        "tie_word_embeddings": "output.weight" not in gguf.tensor_names,
        "attention_bias": any(n.endswith(".attn_q.bias") for n in gguf.tensor_names),
        "mlp_bias": False,
    }
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    elif scaling != "none":
        raise ModelError(f"{gguf.path}: RoPE scaling {scaling!r} is not supported")
    return config


ARCHITECTURES = {
    "llama": Architecture(config=_llama_config, tensor_name=_llama_tensor_name, rope_heads=_llama_rope_heads),
}


# ---- reading -------------------------------------------------------------------------

class GGUFFile:
    """A parsed GGUF: metadata as plain Python values plus the tensor list."""

    def __init__(self, path: Path):
        from gguf import GGUFReader  # only an import reads a GGUF: a start from the cache never does

        self.path = path
        try:
            self.reader = GGUFReader(path)
            self.meta = {name: field.contents() for name, field in self.reader.fields.items()}
        except Exception as exc:  # gguf raises ValueError/IndexError/struct errors on bad files
            raise ModelError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
        self.tensor_names = {t.name for t in self.reader.tensors}
        self.arch_name = self.meta.get("general.architecture")

    @property
    def architecture(self) -> Architecture:
        if self.arch_name not in ARCHITECTURES:
            raise ModelError(
                f"{self.path}: GGUF architecture {self.arch_name!r} is not supported "
                f"(supported: {', '.join(sorted(ARCHITECTURES))})"
            )
        return ARCHITECTURES[self.arch_name]


def read_gguf(path: Path) -> GGUFFile:
    """Parse a GGUF file; `ModelError` naming it if missing or corrupt."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path}: GGUF file not found")
    return GGUFFile(path)


# ---- conversion ----------------------------------------------------------------------

def _convert_tensors(gguf: GGUFFile, config: dict, weights: str, progress: bool):
    """All tensors as HF-named numpy arrays, plus mlx-lm per-layer quantization entries."""
    from lockstep.models.gguf_tensors import GROUP_SIZE, NATIVE_BITS, dequantized, native_affine, unpermute_rope_rows

    arch = gguf.architecture
    out: dict[str, np.ndarray] = {}
    quantized: dict[str, dict | bool] = {}
    float_dtype = np.float16 if weights == "float16" else np.float32
    for t in tqdm(gguf.reader.tensors, desc=f"import {gguf.path.name} [{weights}]", unit="tensor", disable=not progress):
        name = arch.tensor_name(t.name)
        if name is None:
            raise ModelError(f"{gguf.path}: unexpected tensor {t.name!r} for architecture {gguf.arch_name!r}")
        cols = int(t.shape[0])
        rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 0
        if weights == "q4" and rows and t.tensor_type in NATIVE_BITS and cols % GROUP_SIZE == 0:
            arrays = native_affine(t.data.reshape(rows, -1), t.tensor_type, cols)
            quantized[name.rsplit(".", 1)[0]] = {"group_size": GROUP_SIZE, "bits": NATIVE_BITS[t.tensor_type]}
        else:
            w = dequantized(t.data, t.tensor_type, float_dtype)
            w = w.reshape(rows, cols) if rows else w.reshape(cols)
            arrays = {"weight": w}
            if rows and weights == "q4":
                quantized[name.rsplit(".", 1)[0]] = False  # kept in float: no native form
        heads = arch.rope_heads(t.name, config)
        base, leaf = name.rsplit(".", 1)
        for key, a in arrays.items():
            if heads:
                a = unpermute_rope_rows(a, heads)
            out[f"{base}.{key}" if key != "weight" else f"{base}.{leaf}"] = np.ascontiguousarray(a)
    return out, quantized


def _cache_key(path: Path, weights: str) -> str:
    st = path.stat()
    digest = hashlib.sha256(f"{IMPORT_FORMAT_VERSION}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return f"{path.stem}-{digest}-{weights}"


def default_cache_root() -> Path:
    return cache_dir.user_root() / "models"


def imported_dir(path: Path, weights: str, cache_root: Path | None = None) -> Path:
    """Where the import of `path` with `weights` lives (whether or not it exists yet)."""
    return (cache_root or default_cache_root()) / _cache_key(Path(path), weights)


def _write_model_dir(gguf: GGUFFile, weights: str, out: Path, progress: bool) -> None:
    from lockstep.models.gguf_tensors import GROUP_SIZE

    vocab = GGUFVocab(gguf.meta, gguf.path)
    config = gguf.architecture.config(gguf.meta, gguf)
    tensors, quantized = _convert_tensors(gguf, config, weights, progress)
    eos_ids = vocab.eos_token_ids()
    config["bos_token_id"] = vocab.bos_id
    config["eos_token_id"] = eos_ids
    if weights == "q4":
        config["quantization"] = {"group_size": GROUP_SIZE, "bits": 4, "mode": "affine", **quantized}
    config["lockstep"] = {"source": str(gguf.path), "weights": weights, "gguf_name": gguf.meta.get("general.name")}
    try:  # MLX reports a file it cannot open or write (a full disk) as a RuntimeError
        mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in tensors.items()},
                            metadata={"format": "mlx"})
    except RuntimeError as exc:
        raise OSError(errno.EIO, f"{exc} (is the disk full?)", str(out / "model.safetensors")) from exc
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": vocab.bos_id, "eos_token_id": eos_ids}
    if vocab.pad_id is not None:
        generation["pad_token_id"] = vocab.pad_id
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    write_tokenizer(vocab, out, config["max_position_embeddings"])


# An import in progress is `.<final name>.<pid>.<random>.tmp`; one whose process is gone
# (killed mid-import) is swept. Names without a pid count as stale after this many seconds.
STALE_TMP_WITHOUT_PID_S = 3600


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def sweep_stale_imports(cache_root: Path) -> list[Path]:
    """Remove temporary import directories left by killed imports. Returns what was removed."""
    removed = []
    try:
        candidates = [p for p in cache_root.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]
    except OSError:
        return removed
    for tmp in candidates:
        parts = tmp.name.rsplit(".", 3)  # ".name", pid, random, "tmp" (the name may hold dots)
        pid = int(parts[1]) if len(parts) == 4 and parts[1].isdigit() else None
        try:
            stale = (not _process_alive(pid) if pid is not None
                     else time.time() - tmp.stat().st_mtime > STALE_TMP_WITHOUT_PID_S)
        except OSError:
            continue
        if stale and pid != os.getpid():
            shutil.rmtree(tmp, ignore_errors=True)
            log.warning("removed %s, left by an import that did not finish", tmp)
            removed.append(tmp)
    return removed


def _safetensors_damage(path: Path) -> str | None:
    """Why a safetensors file is not whole: its size must be what its header says."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{path.name} is {len(head)} bytes, shorter than its header"
        length = int.from_bytes(head, "little")
        size = os.fstat(f.fileno()).st_size
        if length > size - 8:
            return f"{path.name} is {size} bytes, shorter than its {length}-byte header"
        header = json.loads(f.read(length))
    end = max((t["data_offsets"][1] for name, t in header.items() if name != "__metadata__"), default=0)
    if size != 8 + length + end:
        return f"{path.name} is {size} bytes, its header says {8 + length + end}"
    return None


def damage(model_dir: Path) -> str | None:
    """Why an imported directory would not load (None: whole, as far as reading it cheaply
    tells): a file missing, JSON that does not parse, weights shorter than their header says."""
    try:
        for name in ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json"):
            try:
                json.loads((model_dir / name).read_bytes())
            except ValueError as exc:
                return f"{name} is not valid JSON ({exc})"
        return _safetensors_damage(model_dir / "model.safetensors")
    except FileNotFoundError as exc:
        return f"{Path(exc.filename).name} is missing"
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        return f"model.safetensors has a malformed header ({type(exc).__name__}: {exc})"
    except OSError as exc:
        return f"{exc.filename or model_dir} cannot be read ({cache_dir.reason(exc)})"


def _discard(model_dir: Path) -> None:
    """Remove a cached import: renamed aside first (a name `sweep_stale_imports` knows), so no
    start ever sees it half deleted."""
    aside = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.{os.getpid()}.", suffix=".tmp", dir=model_dir.parent))
    try:
        os.rename(model_dir, aside / model_dir.name)
    except FileNotFoundError:
        pass  # another start discarded it first
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _fsync_tree(directory: Path) -> None:
    for child in directory.iterdir():
        cache_dir.fsync_path(child)
    cache_dir.fsync_path(directory)


def _import_into(root: Path, gguf_path: Path, weights: str, progress: bool, reimport: bool) -> Path:
    """Import into `root` (see import_gguf); OSError where `root` cannot be written."""
    final = imported_dir(gguf_path, weights, root)
    sweep_stale_imports(root)
    if final.exists():
        if not reimport:
            why = damage(final)
            if why is None:
                return final
            log.warning("re-importing %s into %s: %s", gguf_path, final, why)
        _discard(final)
    gguf = read_gguf(gguf_path)
    gguf.architecture  # refuse unsupported architectures before any work
    cache_dir.make_dirs(root)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.{os.getpid()}.", suffix=".tmp", dir=root))
    try:
        _write_model_dir(gguf, weights, tmp, progress)
        why = damage(tmp)
        if why is not None:  # written short without an error: never rename it into the cache
            raise OSError(errno.EIO, f"the import was written damaged ({why})", str(tmp))
        _fsync_tree(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a concurrent import that won the race
                raise
        cache_dir.fsync_path(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("imported %s (%s) into %s", gguf.path, weights, final)
    return final


def import_gguf(path: Path, weights: str = "q4", cache_root: Path | None = None, progress: bool = True,
                reimport: bool = False) -> Path:
    """Convert a GGUF file into an mlx-lm directory (cached); returns the directory.

    The directory is built in a temporary sibling and renamed into place, so the cache
    never holds a half-written model; siblings left by killed imports are swept first.
    A cached directory that is damaged (`damage`), or any with `reimport`, is imported
    again. Where the cache root cannot be written (not a directory, read-only, full), the
    import goes to a private temporary directory, said in one line.
    """
    if weights not in WEIGHT_FORMATS:
        raise ModelError(f"{path}: unknown weights format {weights!r} (choose from {', '.join(WEIGHT_FORMATS)})")
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path}: GGUF file not found")
    root = cache_root or default_cache_root()
    try:
        return _import_into(root, path, weights, progress, reimport)
    except OSError as exc:
        problem = f"{root}: {cache_dir.reason(exc)}"
    try:
        fallback = cache_dir.fallback_root() / "models"
    except OSError as exc:
        raise ModelError(f"{path}: cannot import into the cache ({problem}) nor a temporary directory "
                         f"({exc.filename}: {cache_dir.reason(exc)})") from exc
    log.warning("cache directory unusable, %s; importing %s into %s instead", problem, path.name, fallback)
    try:
        return _import_into(fallback, path, weights, progress, reimport)
    except OSError as exc:
        raise ModelError(f"{path}: cannot import into the cache ({problem}) nor into {fallback} "
                         f"({exc.filename or fallback}: {cache_dir.reason(exc)})") from exc
