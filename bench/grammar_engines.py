"""Grammar engines for constrained decoding, measured on the embedded model's tokenizer.

    .venv/bin/python bench/grammar_engines.py [--out bench/results/grammar_engines.txt]

For each engine installed (llguidance, xgrammar, outlines-core) it measures:
- tokenizer setup (once per loaded model);
- compile: schema → a matcher with its first mask computed (what a request waits for,
  engine caches disabled);
- mask time per token: at each step of a walk that consumes a valid JSON document token by
  token, the time to compute the next-token bitmask (mean and p99), on a realistic
  structured-output schema and on every covered schema;
- schema coverage over 14 schemas of what OpenAI structured outputs use: a schema counts as
  honoured when it compiles, its valid instance walks through (every token allowed, accepting
  at the end) and each of its invalid instances is refused (some token masked out, or not
  accepting at the end) — an engine that ignores a keyword fails the last check.
The same run times the model's own decode step (one token through `m.model` with a KV cache,
float weights as loaded), so mask time can be read as a fraction of a decode step.
Engines that are not installed are reported as such.
"""
from __future__ import annotations

import argparse
import gc
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.grammar_schemas import REALISTIC_INSTANCE, REALISTIC_SCHEMA, SCHEMAS, UNSUPPORTED  # noqa: E402


def dump(value) -> str:
    # The layout every engine is configured for: ", " and ": " separators, no newlines.
    return json.dumps(value, separators=(", ", ": "))


def bit(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


class Llguidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size, eos_ids):
        import llguidance
        import llguidance.hf

        self.ll = llguidance
        self.version = llguidance.__version__
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_ids))
        self.words = (vocab_size + 31) // 32

    def compile(self, schema):
        options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        matcher = self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill(self, matcher, mask):
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)

    def consume(self, matcher, token):
        return matcher.consume_token(token)

    def accepting(self, matcher):
        return matcher.is_accepting()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab_size, eos_ids):
        import xgrammar

        self.xgr = xgrammar
        from importlib.metadata import version

        self.version = version("xgrammar")
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_ids))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)  # a torch tensor
        self.words = (vocab_size + 31) // 32

    def compile(self, schema):
        compiled = self.compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "), strict_mode=True)
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, mask):
        matcher.fill_next_token_bitmask(self.bitmask)
        mask[:] = self.bitmask.numpy()[0]

    def consume(self, matcher, token):
        return matcher.accept_token(token)

    def accepting(self, matcher):
        # xgrammar accepts the stop token once the grammar can end
        return matcher.is_completed() or matcher.fork().accept_token(matcher.stop_token_ids[0])


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, hf_tokenizer, vocab_size, eos_ids):
        import outlines_core
        from importlib.metadata import version
        from outlines_core.json_schema import build_regex_from_schema

        self.oc = outlines_core
        self.build_regex = build_regex_from_schema
        self.version = version("outlines-core")
        # Byte-level BPE: token strings spell bytes with GPT-2's byte↔unicode table.
        byte_of = {c: b for b, c in byte_level_alphabet().items()}
        special = set(hf_tokenizer.all_special_ids)
        tokens: dict[bytes, list[int]] = {}
        for text, token in hf_tokenizer.get_vocab().items():
            if token in special or any(c not in byte_of for c in text):
                continue
            tokens.setdefault(bytes(byte_of[c] for c in text), []).append(token)
        eos = min(eos_ids)
        self.vocabulary = outlines_core.Vocabulary(eos, tokens)
        self.words = (vocab_size + 31) // 32

    def compile(self, schema):
        regex = self.build_regex(json.dumps(schema), r"[ ]?")
        return self.oc.Guide(self.oc.Index(regex, self.vocabulary))

    def fill(self, matcher, mask):
        matcher.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)

    def consume(self, guide, token):
        try:
            guide.advance(token)
            return True
        except Exception:
            return False

    def accepting(self, guide):
        return guide.is_finished() or self.vocabulary.get_eos_token_id() in guide.get_tokens()


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable character table (byte-level BPE vocabularies spell bytes with it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = chr(256 + extra), extra + 1
    return table


ENGINES = [Llguidance, Xgrammar, OutlinesCore]


def walk(engine, matcher, tokens: list[int], times: list[float] | None = None) -> bool:
    """Consume `tokens`, checking each against the mask; True if all allowed and accepting at the end."""
    mask = np.zeros(engine.words, dtype=np.int32)
    for token in tokens:
        start = time.perf_counter()
        engine.fill(matcher, mask)
        if times is not None:
            times.append(time.perf_counter() - start)
        if not bit(mask, token) or not engine.consume(matcher, token):
            return False
    return engine.accepting(matcher)


def compile_timed(engine, schema):
    """Compile + matcher + first mask: what a request waits for before its first constrained token."""
    start = time.perf_counter()
    matcher = engine.compile(schema)
    engine.fill(matcher, np.zeros(engine.words, dtype=np.int32))
    return matcher, time.perf_counter() - start


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99)) if values else float("nan")


def decode_step_seconds(model, tokenizer, steps: int = 40) -> list[float]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    prompt = tokenizer.encode("Write the order as JSON: two keyboards, one mouse, shipped to Grace.")
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    mx.eval(logits)
    token = mx.argmax(logits[:, -1, :], axis=-1)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = model(token[:, None], cache=cache)
        token = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(token)
        times.append(time.perf_counter() - start)
    return times[5:]  # the first steps warm up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "grammar_engines.txt"))
    args = parser.parse_args()

    import jsonschema

    from lockstep.models.load import load_model

    m = load_model("default")
    hf = m.tokenizer._tokenizer
    vocab_size = m.model.args.vocab_size  # the logits width
    out = io.StringIO()

    def say(line: str = "") -> None:
        print(line, flush=True)
        out.write(line + "\n")

    # The instances themselves are checked by the reference validator, so coverage means what it says.
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    for name, (schema, valid, invalids) in SCHEMAS.items():
        jsonschema.validate(valid, schema, format_checker=checker)
        for bad in invalids:
            assert not jsonschema.Draft202012Validator(schema, format_checker=checker).is_valid(bad), (name, bad)
    jsonschema.validate(REALISTIC_INSTANCE, REALISTIC_SCHEMA, format_checker=checker)

    encode = lambda value: hf.encode(dump(value), add_special_tokens=False)  # noqa: E731
    realistic_tokens = encode(REALISTIC_INSTANCE)

    say(f"model: {m.name} ({m.weights}), tokenizer {type(hf).__name__}, vocab {vocab_size}, eos {sorted(m.eos_token_ids)}")
    say(f"realistic walk: {len(realistic_tokens)} tokens; {len(SCHEMAS)} coverage schemas")
    # 2 cores shared with other work: the load says how contended the timings below are
    say(f"cpu: {os.cpu_count()} cores, load average at start {os.getloadavg()[0]:.2f}")
    # The decode step as loaded by default (auto weights), and with float32 weights; the
    # faster one is the yardstick (the smaller the step, the more a mask costs in proportion).
    decode_ms = float("inf")
    for weights in ("auto", "float32"):
        loaded = m if weights == "auto" else load_model("default", weights=weights)
        step = decode_step_seconds(loaded.model, loaded.tokenizer)
        decode_ms = min(decode_ms, statistics.median(step) * 1e3)
        say(f"decode step ({loaded.name}, {loaded.weights} weights, 1 token, KV cache): "
            f"median {statistics.median(step) * 1e3:.2f} ms, mean {statistics.mean(step) * 1e3:.2f} ms")
        del loaded
    say()

    rows = []
    for engine_class in ENGINES:
        gc.collect()
        try:
            start = time.perf_counter()
            engine = engine_class(hf, vocab_size, m.eos_token_ids)
            setup = time.perf_counter() - start
        except ImportError as exc:
            say(f"{engine_class.name}: not installed ({exc})")
            continue
        say(f"== {engine.name} {engine.version}: tokenizer setup {setup * 1e3:.0f} ms")
        compile_times, all_steps, honoured = [], [], []
        for name, (schema, valid, invalids) in SCHEMAS.items():
            try:
                matcher, seconds = compile_timed(engine, schema)
            except Exception as exc:  # an engine's refusal is a coverage result, not a bench failure
                say(f"  {name:28s} refused: {str(exc).splitlines()[0][:90]}")
                continue
            compile_times.append(seconds)
            accepted = walk(engine, matcher, encode(valid), all_steps)
            refused = [not walk(engine, engine.compile(schema), encode(bad)) for bad in invalids]
            ok = accepted and all(refused)
            honoured.append(ok)
            why = "" if ok else ("valid instance refused" if not accepted else
                                 "accepts " + ", ".join(dump(b) for b, r in zip(invalids, refused) if not r))
            say(f"  {name:28s} compile {seconds * 1e3:8.1f} ms  {'honoured' if ok else 'NOT honoured: ' + why}")
        refused_unsupported = []
        for name, schema in UNSUPPORTED.items():
            try:
                compile_timed(engine, schema)
            except Exception:
                refused_unsupported.append(name)
        say(f"  unsupported keywords refused: {len(refused_unsupported)}/{len(UNSUPPORTED)} "
            f"({', '.join(refused_unsupported) or 'none: the others compile and are ignored'})")
        try:
            realistic, realistic_compile = compile_timed(engine, REALISTIC_SCHEMA)
            steps: list[float] = []
            assert walk(engine, realistic, realistic_tokens, steps), "realistic instance refused"
            for _ in range(2):  # more samples, fresh matchers
                assert walk(engine, engine.compile(REALISTIC_SCHEMA), realistic_tokens, steps)
        except Exception as exc:
            say(f"  realistic schema failed: {exc}")
            realistic_compile, steps = float("nan"), []
        mean_ms = statistics.mean(steps) * 1e3 if steps else float("nan")
        rows.append((engine.name, setup, realistic_compile, statistics.median(compile_times) if compile_times else float("nan"),
                     max(compile_times, default=float("nan")), mean_ms, p99(steps) * 1e3,
                     statistics.mean(all_steps) * 1e3 if all_steps else float("nan"), p99(all_steps) * 1e3,
                     sum(honoured), len(SCHEMAS), len(refused_unsupported)))
        say(f"  realistic schema: compile {realistic_compile * 1e3:.1f} ms, mask mean {mean_ms:.3f} ms, p99 {p99(steps) * 1e3:.3f} ms")
        say()

    say(f"{'engine':14s} {'tok setup':>9s} {'compile':>9s} {'compile':>9s} {'compile':>9s} {'mask':>8s} {'mask':>8s} "
        f"{'mask÷':>7s} {'mask':>8s} {'mask':>8s} {'schemas':>8s} {'refuses':>8s}")
    say(f"{'':14s} {'ms':>9s} {'realistic':>9s} {'median':>9s} {'max':>9s} {'mean ms':>8s} {'p99 ms':>8s} "
        f"{'decode':>7s} {'all mean':>8s} {'all p99':>8s} {'honoured':>8s} {'unsupp.':>8s}")
    for name, setup, rc, cmed, cmax, mean_ms, p99_ms, all_mean, all_p99, ok, total, refused in rows:
        say(f"{name:14s} {setup * 1e3:9.0f} {rc * 1e3:9.1f} {cmed * 1e3:9.1f} {cmax * 1e3:9.1f} {mean_ms:8.3f} {p99_ms:8.3f} "
            f"{mean_ms / decode_ms:7.2%} {all_mean:8.3f} {all_p99:8.3f} {ok:>5d}/{total} {refused:>6d}/{len(UNSUPPORTED)}")
    say("(compile = schema → matcher → first mask, caches off; mask = one next-token bitmask on the realistic walk, "
        "'all' = over every coverage walk; mask÷decode = mean mask ÷ median decode step of the fastest weights)")

    try:  # the server's wrapper on top of the chosen engine: bitmask → mx bool mask, and applying it
        import mlx.core as mx

        from lockstep.server.engine.structured.grammar import GrammarCompiler
        from lockstep.server.engine.decoding.logits_processors import apply_mask

        compiler = GrammarCompiler(m.tokenizer, vocab_size, m.eos_token_ids)
        matcher = compiler.json_schema(REALISTIC_SCHEMA).matcher()
        logits = mx.zeros((vocab_size,), dtype=mx.bfloat16)
        times = []
        for token in realistic_tokens:
            start = time.perf_counter()
            mx.eval(apply_mask(logits, matcher.allowed()))
            times.append(time.perf_counter() - start)
            matcher.consume(token)
        mean_ms = statistics.mean(times) * 1e3
        say(f"server.engine.structured.grammar (allowed() + apply_mask, realistic walk): mean {mean_ms:.3f} ms, p99 {p99(times) * 1e3:.3f} ms, "
            f"÷ decode {mean_ms / decode_ms:.2%}")
    except ImportError as exc:
        say(f"server.engine.structured.grammar not measured ({exc})")

    say(f"load average at end {os.getloadavg()[0]:.2f}")
    Path(args.out).write_text(out.getvalue())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
