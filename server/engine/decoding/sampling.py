"""Position-keyed sampling and OpenAI logprobs.

The random noise used to pick the token at absolute sequence position `t` depends only on
`(seed, t)`: Gumbel-max sampling with a key derived from both. So a seed gives the same
tokens however positions are grouped into forward passes (one token per step, or several
verified at once by speculative decoding). Temperature 0 is greedy and uses no noise; so
is any temperature below `GREEDY_BELOW`, where dividing by it would overflow float32 (a
1e-40 temperature once turned every logit into inf/nan and sampled token 0). top-p and
min-p always keep the most likely token, so a tiny `top_p` means greedy, never "nothing".

Logprobs are the log-softmax of the raw logits (before temperature and masks), as OpenAI
reports them.
"""
from __future__ import annotations

import functools
import secrets
from dataclasses import dataclass, field, replace

import mlx.core as mx

from lockstep.server.engine.runner.step_data import Sampled  # the step contract's token; re-exported

_MASK64 = (1 << 64) - 1
# Temperatures below this are greedy: logits / 1e-6 stays finite in float32 for any logit
# a model produces, while far smaller ones overflow (documented in docs/DETERMINISM.md).
GREEDY_BELOW = 1e-6


# A seed the server draws is reported back (`lockstep.seed`, the receipt) for the client to send
# again: within 2**53 it is exact in every JSON parser, JavaScript's doubles included.
DRAWN_SEED_BITS = 53


def draw_seed() -> int:
    return secrets.randbits(DRAWN_SEED_BITS)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    seed: int = field(default_factory=draw_seed)
    top_logprobs: int | None = None  # None = no logprobs; n = the n most likely alternatives

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _key_value(seed: int, position: int) -> int:
    return splitmix64((seed & _MASK64) ^ splitmix64(position))


def key_for(seed: int, position: int) -> mx.array:
    """A PRNG key that depends only on (seed, position)."""
    return mx.random.key(_key_value(seed, position))


def keys_for(seeds: list[int], positions: list[int]) -> mx.array:
    """`key_for` of each (seed, position) as one (rows, 2) array (mx.random.key's two words)."""
    values = [_key_value(seed, position) for seed, position in zip(seeds, positions)]
    return mx.array([[v >> 32, v & 0xFFFFFFFF] for v in values], dtype=mx.uint32)


@functools.lru_cache(maxsize=None)
def _gumbel_rows(vocab: int):
    # one row of noise per key: the random bits are counter-based, so row i is exactly
    # gumbel((vocab,), key=keys[i]) (tests/test_sampling_rows.py)
    return mx.vmap(lambda key: mx.random.gumbel((vocab,), key=key))


def gumbel_noise(seeds: list[int], positions: list[int], vocab: int) -> mx.array:
    """(rows, vocab) Gumbel noise, row i keyed on (seeds[i], positions[i]) alone."""
    return _gumbel_rows(vocab)(keys_for(seeds, positions))


def _mask_top_k(logprobs: mx.array, k: int) -> mx.array:
    if k <= 0 or k >= logprobs.shape[-1]:
        return logprobs
    kth_largest = mx.expand_dims(mx.partition(logprobs, -k, axis=-1)[..., -k], -1)
    return mx.where(logprobs >= kth_largest, logprobs, -mx.inf)


def _mask_top_p(logprobs: mx.array, top_p: float) -> mx.array:
    if top_p >= 1.0:
        return logprobs
    order = mx.argsort(-logprobs, axis=-1)
    sorted_probs = mx.exp(mx.take_along_axis(logprobs, order, axis=-1))
    # Keep a token if the probability mass strictly before it is below top_p (the most
    # likely token is always kept).
    mass_before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    # The most likely token is always kept, even when top_p rounds to 0 in float32.
    keep_sorted = keep_sorted | (mx.arange(keep_sorted.shape[-1]) == 0)
    keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
    return mx.where(keep, logprobs, -mx.inf)


def _mask_min_p(logprobs: mx.array, min_p: float) -> mx.array:
    if min_p <= 0.0:
        return logprobs
    threshold = logprobs.max(axis=-1, keepdims=True) + mx.log(mx.array(min_p))
    return mx.where(logprobs >= threshold, logprobs, -mx.inf)  # log(min_p) <= 0: the top token stays


def filtered_logprobs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Temperature, then top-k, top-p and min-p masks (masked tokens are -inf)."""
    scaled = logits.astype(mx.float32) / params.temperature
    logprobs = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
    logprobs = _mask_top_k(logprobs, params.top_k)
    logprobs = _mask_top_p(logprobs, params.top_p)
    return _mask_min_p(logprobs, params.min_p)


def choose_tokens(logits: mx.array, positions: list[int], params: SamplingParams,
                  seeds: list[int] | None = None) -> mx.array:
    """Token ids for logits of shape (len(positions), vocab); row i is for positions[i], keyed
    on seeds[i] (default: params.seed for every row)."""
    if params.greedy:
        return mx.argmax(logits, axis=-1)
    masked = filtered_logprobs(logits, params)
    seeds = [params.seed] * len(positions) if seeds is None else seeds
    return mx.argmax(masked + gumbel_noise(seeds, positions, logits.shape[-1]), axis=-1)


def _top_n(logprobs: mx.array, n: int) -> tuple[mx.array, mx.array]:
    """The n largest logprobs per row and their ids, most likely first."""
    if n == 0:
        return mx.zeros((logprobs.shape[0], 0), mx.uint32), mx.zeros((logprobs.shape[0], 0))
    candidates = mx.argpartition(-logprobs, n - 1, axis=-1)[:, :n]
    values = mx.take_along_axis(logprobs, candidates, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return mx.take_along_axis(candidates, order, axis=-1), mx.take_along_axis(values, order, axis=-1)


class PendingSample:
    """A sampling decision built but not yet computed: `arrays` can be evaluated together
    with other requests' (one device round trip for a whole pass), then `result()`."""

    def __init__(self, tokens: mx.array, logprob_parts: tuple | None):
        self.tokens = tokens
        self.logprob_parts = logprob_parts  # (chosen, top ids, top values) or None
        self._result: list[Sampled] | None = None

    @property
    def arrays(self) -> list[mx.array]:
        return [self.tokens, *(self.logprob_parts or ())]

    def result(self) -> list[Sampled]:
        if self._result is None:  # read back once: a batch's rows share it (PendingRow)
            mx.eval(self.arrays)  # nothing left to compute when the engine evaluated them already
            if self.logprob_parts is None:
                self._result = [Sampled(token) for token in self.tokens.tolist()]
            else:
                chosen, top_ids, top_values = self.logprob_parts
                self._result = [
                    Sampled(token, logprob, list(zip(ids, values)))
                    for token, logprob, ids, values in zip(
                        self.tokens.tolist(), chosen.tolist(), top_ids.tolist(), top_values.tolist()
                    )
                ]
        return self._result


class PendingRow:
    """Row `index` of a batch's PendingSample (`sample_rows_pending`), as a PendingSample of
    one row: its arrays are the batch's (evaluated once for all), its result that row's."""

    def __init__(self, batch: PendingSample, index: int):
        self.batch, self.index = batch, index

    @property
    def arrays(self) -> list[mx.array]:
        return self.batch.arrays

    @property
    def tokens(self) -> mx.array:
        return self.batch.tokens[self.index:self.index + 1]

    def result(self) -> list[Sampled]:
        return [self.batch.result()[self.index]]


def block_widths(widest: int) -> list[int]:
    """The widths a batch of deterministic rows may take where the batched-sampling proof
    (server/engine/decoding/sampling_proof.py) covered `widest`: the powers of two up to it and
    `widest` itself, ascending; 1 is a row sampled alone. The proof compares exactly these."""
    if widest < 1:
        return []
    return sorted({1 << k for k in range(widest.bit_length())} | {widest})


def split_blocks(rows: int, widest: int) -> list[int]:
    """`rows` rows as blocks of `block_widths(widest)`, largest first (13 under 8: 8, 4, 1), so
    a group takes few samplings and each has a width the proof compared."""
    sizes = []
    for width in reversed(block_widths(max(widest, 1))):
        while rows >= width:
            sizes.append(width)
            rows -= width
    return sizes


@dataclass(frozen=True)
class RowSampling:
    """One row's sampling as a pass builds it with other requests' rows (`batch`): rows of one
    `group` share every sampling field but the seed. `batch_rows`: the widest batch the row may
    join (0: any width; a deterministic row's is the widest the batched-sampling proof proved,
    server/engine/decoding/sampling_proof.py, and its batches take only `block_widths` of it)."""

    params: SamplingParams
    position: int
    batch_rows: int = 0

    @property
    def group(self) -> SamplingParams:
        return replace(self.params, seed=0)

    def blocks(self, rows: int) -> list[int]:
        """The batch widths a group of `rows` rows with this row's `batch_rows` is sampled in,
        in row order: one batch where any width may be, else `split_blocks`'s proven widths."""
        return split_blocks(rows, self.batch_rows) if self.batch_rows else [rows]

    @staticmethod
    def batch(logits: mx.array, rows: list["RowSampling"]) -> list[PendingRow]:
        """The sampling of `rows` (one group) from `logits` (len(rows), vocab), row i's bits
        what `sample_pending(logits[i:i + 1], [position], params)` gives it alone."""
        batch = sample_pending(logits, [row.position for row in rows], rows[0].params,
                               seeds=[row.params.seed for row in rows])
        return [PendingRow(batch, j) for j in range(len(rows))]


def sample_pending(logits: mx.array, positions: list[int], params: SamplingParams,
                   model_logits: mx.array | None = None, seeds: list[int] | None = None) -> PendingSample:
    """`sample`'s computation, built lazily (see PendingSample). `seeds`: row i's seed (several
    requests' rows sampled as one batch, each row's bits its own: every operation here works
    on each row alone); default params.seed for every row."""
    tokens = choose_tokens(logits, positions, params, seeds)
    if params.top_logprobs is None:
        return PendingSample(tokens, None)
    logprobs = (logits if model_logits is None else model_logits).astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    top_ids, top_values = _top_n(logprobs, params.top_logprobs)
    return PendingSample(tokens, (chosen, top_ids, top_values))


def sample(logits: mx.array, positions: list[int], params: SamplingParams,
           model_logits: mx.array | None = None) -> list[Sampled]:
    """Choose one token per row of `logits` (rows, vocab), with logprobs if requested.

    `model_logits` are the rows before per-request processing (penalties, bias, a grammar
    mask; server/engine/decoding/logits_processors.py): logprobs report the model's own distribution.
    """
    return sample_pending(logits, positions, params, model_logits).result()
