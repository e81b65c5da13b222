"""Model directories the benches serve, random weights with the embedded model's tokenizer (its
vocabulary, 49,152, and its chat template: every token id decodes, and chat requests work).

    python bench/model_dirs.py --out DIR [--weights nvfp4|bf16|affine4|...] [--small]

- `write_8b`: an 8B-shaped llama (32 layers, hidden 4096, MLP 14336, 32/8 heads of 128;
  bench/invariant_8b.py's `build`), `--small`: 2 layers, hidden 1024, MLP 2048 (a check on
  the CPU); `build_8b` writes it once, in a child process (a bench that serves it keeps no
  device memory of its own);
- `build_nvfp4_1040`: 2 layers, hidden 1040 (16 mod 32), float16, a tied head, nvfp4 on disk.
A directory is written whole or not at all, so a later run re-uses only a finished one.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.synthetic, for the nvfp4 model

EIGHT_B_SHAPE = {"layers": 32, "hidden": 4096, "intermediate": 14336}
SMALL_SHAPE = {"layers": 2, "hidden": 1024, "intermediate": 2048}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def embedded_source() -> Path:
    """The embedded GGUF's import: its config and tokenizer files."""
    from lockstep.models.resolve import resolve_model

    return resolve_model("default", "float32")


def copy_tokenizer(source: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)


def _written_whole(out: Path, write) -> Path:
    """`write(directory)` into a partial directory, renamed to `out` once done."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    write(partial)
    partial.rename(out)
    return out


def build_nvfp4_1040(out: Path) -> Path:
    """2 layers, hidden 1040, vocab 49152, float16, tied embeddings, nvfp4 on disk (written once)."""
    if (out / "config.json").is_file():
        return out
    import mlx.core as mx
    from mlx_lm.utils import quantize_model

    from tests.synthetic import llama_config, random_llama, write_model_dir

    def write(directory: Path) -> None:
        config = llama_config(vocab=49152)
        model = random_llama(config)
        model.set_dtype(mx.float16)
        model, config = quantize_model(model, config, None, None, mode="nvfp4")
        write_model_dir(model, config, directory)
        copy_tokenizer(embedded_source(), directory)

    return _written_whole(out, write)


def write_8b(out: Path, weights: str, small: bool) -> None:
    """The 8B-shaped model as an mlx-lm directory (in this process)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import invariant_8b
    from mlx_lm.utils import save_config, save_model

    source = embedded_source()
    source_config = json.loads((source / "config.json").read_text())
    shape = SMALL_SHAPE if small else EIGHT_B_SHAPE
    vocab = source_config["vocab_size"]
    model = invariant_8b.build(weights, shape["layers"], hidden=shape["hidden"],
                               intermediate=shape["intermediate"], vocab=vocab)
    config = {"model_type": "llama", "hidden_size": shape["hidden"], "num_hidden_layers": shape["layers"],
              "intermediate_size": shape["intermediate"], "num_attention_heads": 32, "num_key_value_heads": 8,
              "head_dim": 128, "rms_norm_eps": 1e-5, "vocab_size": vocab, "rope_theta": 500000.0,
              "tie_word_embeddings": False, "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
              **{k: source_config[k] for k in ("bos_token_id", "eos_token_id") if k in source_config}}
    quantization = invariant_8b.WEIGHTS[weights]
    if quantization:
        mode, group, bits = quantization
        config["quantization"] = {"group_size": group, "bits": bits, "mode": mode}

    def write(directory: Path) -> None:
        save_model(directory, model)
        save_config(config, directory / "config.json")
        copy_tokenizer(source, directory)

    _written_whole(out, write)


def build_8b(out: Path, weights: str, small: bool) -> Path:
    """The 8B-shaped model, written once, in a child process."""
    if not (out / "config.json").is_file():
        subprocess.run([sys.executable, __file__, "--out", str(out), "--weights", weights,
                        *(["--small"] if small else [])], check=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the model directory to write")
    parser.add_argument("--weights", default="bf16", help="bench/invariant_8b.py's WEIGHTS: bf16, nvfp4, ...")
    parser.add_argument("--small", action="store_true", help="2 layers, hidden 1024 (a check on the CPU)")
    args = parser.parse_args()
    write_8b(Path(args.out), args.weights, args.small)
    return 0


if __name__ == "__main__":
    sys.exit(main())
