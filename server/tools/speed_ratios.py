"""The speed ratios (`lockstep bench`): deterministic mode's cost and speculative decoding's gain,
side by side.

Every ratio compares two configurations timed in the same process, alternating rounds, on
the same prompt: deterministic decode ÷ native decode; deterministic speculative ÷
deterministic plain (prompt lookup on a repetitive task, and a draft model), with the
tokens checked identical; and prefill tokens/s both ways.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from lockstep.server.engine.runner.model_runner import ModelRunner
from lockstep.server.engine.decoding.sampling import SamplingParams
from lockstep.server.engine.decoding.speculative import measure_pass_costs
from lockstep.server.engine.decoding.token_steps import DecodeInputs, Speculation, SpeculationStats, drive, make_source

# A copying task: the answer repeats the prompt, which is what prompt lookup drafts from.
REPETITIVE = ("Copy the following text exactly, word for word:\n\n"
              "The lighthouse stood on a rock at the edge of the bay. Every evening the keeper "
              "climbed the stairs, lit the lamp, and watched the ships pass in the dark. In the "
              "morning he wrote the names of the ships in a book, closed the shutters, and slept.")
OPEN = "Write a short story about a lighthouse keeper."


# Task kinds for speculation: three where the answer copies from the prompt (prompt lookup
# hits), one where it does not.
PARAGRAPH = ("The lighthouse stood on a rock at the edge of the bay. Every evening the keeper "
             "climbed the stairs, lit the lamp, and watched the ships pass in the dark. In the "
             "morning he wrote the names of the ships in a book, closed the shutters, and slept.")
FUNCTION = '''def total_price(items, tax_rate):
    total = 0
    for item in items:
        if item["quantity"] > 0:
            total = total + item["price"] * item["quantity"]
    total = total + total * tax_rate
    return round(total, 2)
'''
QUESTION = "Which planet in the solar system has the longest day, and how long is that day in Earth hours?"
TASKS = {
    "rewrite, one word changed": "Rewrite this paragraph exactly, changing only the word "
                                 f"'evening' to 'night':\n\n{PARAGRAPH}",
    "refactor a function": "Refactor this Python function: rename total_price to order_total "
                           f"and keep everything else the same.\n\n```python\n{FUNCTION}```",
    "JSON quoting the prompt": 'Answer with a JSON object {"question": ..., "answer": ...} whose '
                               f'"question" quotes the question exactly.\n\nQuestion: {QUESTION}',
    "open-ended story": OPEN,
}


def decode(model, prompt: list[int], n: int, method="none", k=0, draft_model=None,
           adaptive=False, pass_costs=None, runner: ModelRunner | None = None, prediction=()):
    """(tokens, decode seconds, stats) for n greedy tokens after prefilling `prompt`;
    `runner`: caches and passes as an engine's runner has them (None: a runner of its own,
    plain caches and model calls, as `lockstep verify` runs); `prediction`: the predicted
    answer's tokens (method "prediction")."""
    stats = SpeculationStats()
    runner = runner or ModelRunner(model, batched=False)
    cache = runner.new_cache(len(prompt) + n + k + 2)
    try:
        for _ in runner.prefill_cache(cache, prompt[:-1]):
            pass
        speculation = Speculation(method, k, adaptive=adaptive, prediction=prediction, draft_model=draft_model,
                                  target=model, pass_costs=pass_costs)
        source = drive(make_source(DecodeInputs(cache, list(prompt), SamplingParams(temperature=0.0)), stats,
                                   speculation), runner, cache)
        tokens = []
        start = time.perf_counter()
        while len(tokens) < n:
            tokens.extend(s.sampled.token for s in next(source))
        return tokens[:n], time.perf_counter() - start, stats
    finally:
        runner.release(cache)


def prefill_seconds(model, prompt: list[int], chunk: int = 512) -> float:
    runner = ModelRunner(model, batched=False)
    cache = runner.new_cache(len(prompt))
    start = time.perf_counter()
    for _ in runner.prefill_cache(cache, prompt, chunk):  # as the engine prefills
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


def chat_tokens(tokenizer, text: str) -> list[int]:
    """`text` as a user's turn in the model's chat template, ready for its answer."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def run_bench(model, tokenizer, set_limit, limit: int, draft_model=None, n_tokens=64, rounds=2,
              prompt_tokens=512, k=None) -> list[Comparison]:
    """set_limit(L) installs L on `model` (0 = native)."""
    k = k or max(1, limit - 1)
    open_prompt, rep_prompt = chat_tokens(tokenizer, OPEN), chat_tokens(tokenizer, REPETITIVE)
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


@dataclass
class TaskResult:
    task: str
    plain: list = field(default_factory=list)  # tokens/s per round
    fixed: list = field(default_factory=list)  # prompt lookup, k fixed
    adaptive: list = field(default_factory=list)  # prompt lookup, adaptive k
    identical: bool = True
    stats: dict = field(default_factory=dict)  # config -> SpeculationStats (last round)
    seconds: dict = field(default_factory=dict)  # config -> decode seconds (last round)

    def cells(self) -> list[str]:
        cells = [self.task, f"{max(self.plain):.1f}"]
        for name, rates in (("fixed", self.fixed), ("adaptive", self.adaptive)):
            st = self.stats[name]
            share = st.draft_seconds / self.seconds[name]
            cells += [f"{max(rates) / max(self.plain):.2f}", f"{st.accepted}/{st.drafted}",
                      f"{st.mean_k:.2f}", f"{100 * share:.2f} %"]
        return cells + [str(self.identical)]


TASK_HEADER = ["task", "plain tok/s", "fixed k ÷ plain", "accepted", "mean k", "drafting share",
               "adaptive ÷ plain", "accepted", "mean k", "drafting share", "tokens identical"]


def run_task_bench(model, tokenizer, k: int, n_tokens=64, rounds=2, pass_costs=None,
                   runner=None) -> list[TaskResult]:
    """Prompt lookup on each of TASKS, fixed k and adaptive k, ÷ plain decoding, deterministic
    (the caller installs L), rounds alternating. `pass_costs` None: measured here. `runner`:
    every decode run as the engine runs it (ModelRunner.as_engine_runs)."""
    if pass_costs is None:
        pass_costs = measure_pass_costs(model, k + 1, runner=runner)
    chat = lambda text: chat_tokens(tokenizer, text)  # noqa: E731
    results = [TaskResult(name) for name in TASKS]
    decode(model, chat(OPEN), 4, runner=runner)  # warm-up
    for _ in range(rounds):
        for result in results:
            prompt = chat(TASKS[result.task])
            plain, secs, _ = decode(model, prompt, n_tokens, runner=runner)
            result.plain.append(n_tokens / secs)
            for name, rates, adaptive in (("fixed", result.fixed, False), ("adaptive", result.adaptive, True)):
                tokens, secs, stats = decode(model, prompt, n_tokens, "prompt_lookup", k,
                                             adaptive=adaptive, pass_costs=pass_costs, runner=runner)
                rates.append(n_tokens / secs)
                result.identical = result.identical and tokens == plain
                result.stats[name], result.seconds[name] = stats, secs
    return results


def task_table(results: list[TaskResult], pass_costs: list[float]) -> list[str]:
    relative = ", ".join(f"{c / pass_costs[0]:.2f}" for c in pass_costs)
    lines = [f"pass cost of 1..{len(pass_costs)} rows, in single-row passes: {relative}",
             "| " + " | ".join(TASK_HEADER) + " |", "|" + "---|" * len(TASK_HEADER)]
    return lines + ["| " + " | ".join(r.cells()) + " |" for r in results]


# Predicted Outputs on the copy-heavy tasks: what a client would send as its prediction (the
# text the answer is an edit of); the story has none (no prediction but the answer itself).
PREDICTIONS = {
    "rewrite, one word changed": PARAGRAPH,
    "refactor a function": f"```python\n{FUNCTION}```",
    "JSON quoting the prompt": f'{{"question": "{QUESTION}", "answer": ""}}',
}


@dataclass
class PredictionResult:
    task: str
    plain: list = field(default_factory=list)  # tokens/s per round
    exact: list = field(default_factory=list)  # prediction = the answer
    edited: list = field(default_factory=list)  # prediction = PREDICTIONS[task]
    identical: bool = True
    stats: dict = field(default_factory=dict)  # config -> SpeculationStats (last round)

    def cells(self) -> list[str]:
        cells = [self.task, f"{max(self.plain):.1f}"]
        for name, rates in (("exact", self.exact), ("edited", self.edited)):
            if not rates:
                cells += ["—", "—", "—"]
                continue
            st = self.stats[name]
            cells += [f"{max(rates):.1f}", f"{max(rates) / max(self.plain):.2f}",
                      f"{st.accepted}/{st.drafted - st.accepted}"]
        return cells + [str(self.identical)]


PREDICTION_HEADER = ["task", "plain tok/s", "prediction = answer: tok/s", "÷ plain", "accepted/rejected",
                     "prediction = the text edited: tok/s", "÷ plain", "accepted/rejected", "tokens identical"]


def run_prediction_bench(model, tokenizer, k: int, n_tokens=64, rounds=2, runner=None) -> list[PredictionResult]:
    """Predicted Outputs (drafts from the client's prediction, k fixed) ÷ plain decoding on each
    of TASKS, deterministic (the caller installs L), rounds alternating: with the answer itself
    as the prediction, and with the text the answer edits (PREDICTIONS). Tokens are checked
    identical to plain decoding's."""
    chat = lambda text: chat_tokens(tokenizer, text)  # noqa: E731
    encode = lambda text: list(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    results = [PredictionResult(name) for name in TASKS]
    decode(model, chat(OPEN), 4, runner=runner)  # warm-up
    for _ in range(rounds):
        for result in results:
            prompt = chat(TASKS[result.task])
            plain, secs, _ = decode(model, prompt, n_tokens, runner=runner)
            result.plain.append(n_tokens / secs)
            guesses = [("exact", result.exact, plain)]
            if result.task in PREDICTIONS:
                guesses.append(("edited", result.edited, encode(PREDICTIONS[result.task])))
            for name, rates, prediction in guesses:
                tokens, secs, stats = decode(model, prompt, n_tokens, "prediction", k, runner=runner,
                                             prediction=prediction)
                rates.append(n_tokens / secs)
                result.identical = result.identical and tokens == plain
                result.stats[name] = stats
    return results


def prediction_table(results: list[PredictionResult]) -> list[str]:
    lines = ["| " + " | ".join(PREDICTION_HEADER) + " |", "|" + "---|" * len(PREDICTION_HEADER)]
    return lines + ["| " + " | ".join(r.cells()) + " |" for r in results]


def run_exit_layer_bench(model, tokenizer, exit_layers: list[int], k: int, n_tokens=64, rounds=1,
                         tasks=("rewrite, one word changed", "open-ended story")) -> list[str]:
    """Self-speculation (EarlyExitModel: the target's first layers and its own head as the
    draft), fixed k, deterministic, ÷ plain per exit layer and task, tokens checked
    identical: the measurement an exit layer is chosen by."""
    from lockstep.server.engine.decoding.drafters import EarlyExitModel

    chat = lambda text: chat_tokens(tokenizer, text)  # noqa: E731
    depth = len(model.model.layers)
    lines = ["| exit layer | task | accepted | acceptance | self-spec ÷ plain | tokens identical |",
             "|---|---|---|---|---|---|"]
    decode(model, chat(OPEN), 4)  # warm-up
    for layer in exit_layers:
        draft = EarlyExitModel(model, layer)
        for task in tasks:
            prompt = chat(TASKS[task])
            plain_rates, spec_rates, identical, stats = [], [], True, None
            for _ in range(rounds):
                plain, secs, _ = decode(model, prompt, n_tokens)
                plain_rates.append(n_tokens / secs)
                spec, secs, stats = decode(model, prompt, n_tokens, "draft", k, draft)
                spec_rates.append(n_tokens / secs)
                identical = identical and spec == plain
            rate = stats.accepted / stats.drafted if stats.drafted else 0.0
            lines.append(f"| {layer}/{depth} | {task} | {stats.accepted}/{stats.drafted} | {rate:.2f} | "
                         f"{max(spec_rates) / max(plain_rates):.2f} | {identical} |")
    return lines
