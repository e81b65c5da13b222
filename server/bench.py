"""`lockstep bench`: deterministic mode's cost and speculative decoding's gain, side by side.

Every ratio compares two configurations timed in the same process, alternating rounds, on
the same prompt: deterministic decode ÷ native decode; deterministic speculative ÷
deterministic plain (prompt lookup on a repetitive task, and a draft model), with the
tokens checked identical; and prefill tokens/s both ways.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from mlx_lm.models.cache import make_prompt_cache

from server.engine.generate import forward, prefill
from server.engine.sampling import SamplingParams
from server.engine.token_steps import SpeculationStats
from server.verify import start_decoding

# A copying task: the answer repeats the prompt, which is what prompt lookup drafts from.
REPETITIVE = ("Copy the following text exactly, word for word:\n\n"
              "The lighthouse stood on a rock at the edge of the bay. Every evening the keeper "
              "climbed the stairs, lit the lamp, and watched the ships pass in the dark. In the "
              "morning he wrote the names of the ships in a book, closed the shutters, and slept.")
OPEN = "Write a short story about a lighthouse keeper."


def decode(model, prompt: list[int], n: int, method="none", k=0, draft_model=None):
    """(tokens, decode seconds, stats) for n greedy tokens after prefilling `prompt`."""
    stats = SpeculationStats()
    source = start_decoding(model, prompt, SamplingParams(temperature=0.0), stats, method, k,
                            draft_model)
    tokens = []
    start = time.perf_counter()
    while len(tokens) < n:
        tokens.extend(s.sampled.token for s in next(source))
    return tokens[:n], time.perf_counter() - start, stats


def prefill_seconds(model, prompt: list[int], chunk: int = 512) -> float:
    cache = make_prompt_cache(model)
    start = time.perf_counter()
    for _ in prefill(model, cache, prompt, forward, chunk):
        pass
    return time.perf_counter() - start


@dataclass
class Comparison:
    name: str
    a: str
    b: str
    a_rate: list = field(default_factory=list)  # tokens/s per round
    b_rate: list = field(default_factory=list)
    identical: bool | None = None
    note: str = ""

    def ratio(self) -> float:
        return max(self.b_rate) / max(self.a_rate)

    def line(self) -> str:
        same = "" if self.identical is None else f"  tokens identical: {self.identical}"
        return (f"{self.name:<34} {self.b} {max(self.b_rate):8.1f} tok/s ÷ {self.a} "
                f"{max(self.a_rate):8.1f} tok/s = {self.ratio():5.2f}x{same}{('  ' + self.note) if self.note else ''}")


def run_bench(model, tokenizer, set_limit, limit: int, draft_model=None, n_tokens=64, rounds=2,
              prompt_tokens=512, k=None) -> list[Comparison]:
    """set_limit(L) installs L on `model` (0 = native)."""
    k = k or max(1, limit - 1)
    chat = lambda text: tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                       add_generation_prompt=True)
    open_prompt, rep_prompt = chat(OPEN), chat(REPETITIVE)
    long_prompt = (open_prompt * (prompt_tokens // len(open_prompt) + 1))[:prompt_tokens]

    decode_cmp = Comparison("decode (plain)", "native", "deterministic")
    prefill_cmp = Comparison(f"prefill ({prompt_tokens} tokens)", "native", "deterministic")
    lookup_cmp = Comparison(f"prompt lookup k={k}, repetitive", "det. plain", "det. spec")
    draft_cmp = Comparison(f"draft model k={k}", "det. plain", "det. spec") if draft_model else None
    outputs = {}
    decode(model, open_prompt, 4)  # warm-up: compile and allocate once
    for _ in range(rounds):
        for limit_now, rates, p_rates in ((0, decode_cmp.a_rate, prefill_cmp.a_rate),
                                         (limit, decode_cmp.b_rate, prefill_cmp.b_rate)):
            set_limit(limit_now)
            tokens, secs, _ = decode(model, open_prompt, n_tokens)
            rates.append(n_tokens / secs)
            outputs.setdefault(("plain", limit_now), tokens)
            p_rates.append(len(long_prompt) / prefill_seconds(model, long_prompt))
        set_limit(limit)
        for cmp, method, prompt in ((lookup_cmp, "prompt_lookup", rep_prompt),
                                    (draft_cmp, "draft", open_prompt)):
            if cmp is None:
                continue
            plain, secs, _ = decode(model, prompt, n_tokens)
            cmp.a_rate.append(n_tokens / secs)
            spec, secs, stats = decode(model, prompt, n_tokens, method, k, draft_model)
            cmp.b_rate.append(n_tokens / secs)
            cmp.identical = (cmp.identical is not False) and plain == spec
            cmp.note = f"accepted {stats.accepted}/{stats.drafted} drafts"
    decode_cmp.identical = outputs[("plain", 0)] == outputs[("plain", limit)]
    return [c for c in (decode_cmp, lookup_cmp, draft_cmp, prefill_cmp) if c is not None]
