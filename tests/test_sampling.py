"""Position-keyed sampling: masks, seeds, logprobs, independence from grouping."""
import mlx.core as mx
import numpy as np

from lockstep.server.engine.decoding.sampling import SamplingParams, choose_tokens, key_for, sample

VOCAB = 64


def random_logits(rows, seed=0):
    return mx.array(np.random.default_rng(seed).normal(scale=3.0, size=(rows, VOCAB)).astype(np.float32))


def test_greedy_is_argmax_and_ignores_seed():
    logits = random_logits(8)
    expected = np.argmax(np.array(logits), axis=-1).tolist()
    for seed in (0, 1, 99):
        params = SamplingParams(temperature=0.0, seed=seed)
        assert [s.token for s in sample(logits, list(range(8)), params)] == expected


def test_same_seed_same_tokens_regardless_of_grouping():
    logits = random_logits(10)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=7)
    positions = list(range(100, 110))
    together = choose_tokens(logits, positions, params).tolist()
    one_by_one = [choose_tokens(logits[i : i + 1], [p], params).item() for i, p in enumerate(positions)]
    in_threes = sum((choose_tokens(logits[i : i + 3], positions[i : i + 3], params).tolist()
                     for i in range(0, 10, 3)), [])
    assert together == one_by_one == in_threes


def test_noise_depends_on_seed_and_position():
    flat = mx.zeros((200, VOCAB))  # uniform: the token is decided by the noise alone
    a = choose_tokens(flat, list(range(200)), SamplingParams(seed=1)).tolist()
    b = choose_tokens(flat, list(range(200)), SamplingParams(seed=2)).tolist()
    shifted = choose_tokens(flat, list(range(1, 201)), SamplingParams(seed=1)).tolist()
    assert a != b
    assert a[1:] == shifted[:-1]
    assert len(set(a)) > 20
    assert not mx.array_equal(key_for(1, 5), key_for(1, 6))


def test_top_k_one_and_tiny_top_p_and_full_min_p_are_greedy():
    logits = random_logits(20, seed=3)
    greedy = np.argmax(np.array(logits), axis=-1).tolist()
    positions = list(range(20))
    for params in (
        SamplingParams(temperature=2.0, top_k=1, seed=5),
        SamplingParams(temperature=2.0, top_p=1e-6, seed=5),
        SamplingParams(temperature=2.0, min_p=1.0, seed=5),
    ):
        assert choose_tokens(logits, positions, params).tolist() == greedy


def test_top_k_keeps_samples_within_the_k_most_likely():
    row = random_logits(1, seed=4)
    logits = mx.broadcast_to(row, (300, VOCAB))
    allowed = set(np.argsort(-np.array(row[0]))[:5].tolist())
    tokens = choose_tokens(logits, list(range(300)), SamplingParams(temperature=2.0, top_k=5, seed=11))
    assert set(tokens.tolist()) == allowed


def test_sampled_frequencies_follow_the_distribution():
    probs = np.array([0.6, 0.3, 0.1])
    logits = mx.broadcast_to(mx.array(np.log(probs), dtype=mx.float32), (4000, 3))
    tokens = np.array(choose_tokens(logits, list(range(4000)), SamplingParams(seed=3)))
    freq = np.bincount(tokens, minlength=3) / 4000
    assert np.allclose(freq, probs, atol=0.03), freq


def test_logprobs_are_raw_log_softmax_with_sorted_alternatives():
    logits = random_logits(4, seed=6)
    params = SamplingParams(temperature=0.7, top_k=10, seed=2, top_logprobs=5)
    raw = np.array(logits, dtype=np.float64)
    log_softmax = raw - np.log(np.exp(raw).sum(axis=-1, keepdims=True))
    for row, s in enumerate(sample(logits, [0, 1, 2, 3], params)):
        assert abs(s.logprob - log_softmax[row, s.token]) < 1e-4
        ids = [t for t, _ in s.top_logprobs]
        values = [v for _, v in s.top_logprobs]
        assert ids == np.argsort(-log_softmax[row])[:5].tolist()
        assert values == sorted(values, reverse=True)
        assert np.allclose(values, log_softmax[row, ids], atol=1e-4)


def test_no_logprobs_unless_asked_and_zero_alternatives():
    logits = random_logits(2)
    assert sample(logits, [0, 1], SamplingParams(temperature=0.0))[0].logprob is None
    zero = sample(logits, [0, 1], SamplingParams(temperature=0.0, top_logprobs=0))
    assert zero[0].logprob is not None and zero[0].top_logprobs == []
