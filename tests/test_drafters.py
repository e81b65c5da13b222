"""The drafters that propose from text (server/engine/decoding/drafters.py): prompt lookup's
matcher, a draft model's tokenizer check, and Predicted Outputs (PredictionDrafter: drafting
from where the output agrees with the prediction, re-alignment after an edit through its
index); speculation from a prediction equals plain greedy decoding on a tiny random llama."""
import pytest

from lockstep.server.engine.decoding.drafters import PromptLookupDrafter, draft_tokenizer_problem
from tests.test_speculative import plain_greedy, speculative_greedy, tiny_llama


# ------------------------------------------------------------ prompt lookup matcher

def test_prompt_lookup_proposes_continuation_of_latest_match():
    drafter = PromptLookupDrafter(max_ngram=2)
    assert drafter.propose([5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6], 3) == [9, 2, 5]
    assert drafter.propose([1, 2, 3], 4) == []


def test_prompt_lookup_prefers_the_longest_recurring_suffix_over_a_more_recent_shorter_one():
    drafter = PromptLookupDrafter(max_ngram=8)
    #         [1 2 3] 40 41 | 9 3 50 51 | 1 2 3  -> "1 2 3" recurs at the start (n = 3);
    #         "3" alone recurs more recently (before 50)
    context = [1, 2, 3, 40, 41, 9, 3, 50, 51, 1, 2, 3]
    assert drafter.match(context) == (3, 3)
    assert drafter.propose(context, 2) == [40, 41]


def test_prompt_lookup_takes_the_most_recent_of_equally_long_matches_and_stops_at_the_end():
    drafter = PromptLookupDrafter(max_ngram=4)
    context = [7, 8, 1, 7, 8, 2, 5, 7, 8]
    assert drafter.propose(context, 5) == [2, 5, 7, 8]  # the continuation ends where context does
    assert drafter.propose([4, 5, 6, 7], 3) == []  # nothing recurs: no drafts
    assert drafter.propose(context, 0) == []


def test_prompt_lookup_caps_the_ngram_and_honours_min_ngram():
    context = [1, 2, 3, 4, 10, 9, 4, 20, 1, 2, 3, 4]
    assert PromptLookupDrafter(max_ngram=8).propose(context, 1) == [10]  # n = 4 at the start
    assert PromptLookupDrafter(max_ngram=1).propose(context, 1) == [20]  # n = 1: most recent "4"
    assert PromptLookupDrafter(max_ngram=8, min_ngram=2).propose([5, 1, 6, 1], 2) == []
    with pytest.raises(ValueError):
        PromptLookupDrafter(max_ngram=2, min_ngram=3)


def test_prompt_lookup_agrees_with_a_brute_force_search_on_random_contexts():
    import random

    rng = random.Random(0)
    drafter = PromptLookupDrafter(max_ngram=5)
    for _ in range(300):
        context = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        expected = []
        for n in range(min(5, len(context) - 1), 0, -1):  # large to small, most recent first
            tail = context[len(context) - n:]
            hits = [s for s in range(len(context) - n - 1, -1, -1) if context[s:s + n] == tail]
            if hits:
                expected = context[hits[0] + n:hits[0] + n + 3]
                break
        assert drafter.propose(context, 3) == expected, context



# ------------------------------------------------------------ draft tokenizer

class _Vocab:
    def __init__(self, vocab):
        self._vocab = vocab

    def get_vocab(self):
        return dict(self._vocab)


def test_a_draft_with_another_tokenizer_is_refused():
    target = _Vocab({"a": 0, "b": 1, "c": 2})
    assert draft_tokenizer_problem(target, _Vocab({"a": 0, "b": 1, "c": 2})) is None
    problem = draft_tokenizer_problem(target, _Vocab({"a": 0, "c": 1, "b": 2}))
    assert problem and "tokenizer differs" in problem and "2 of the target's token ids" in problem
    assert draft_tokenizer_problem(target, _Vocab({"a": 0, "b": 1})) is not None
    assert draft_tokenizer_problem(target, object()) is not None


def test_build_runtime_refuses_a_draft_model_with_another_tokenizer(monkeypatch):
    from types import SimpleNamespace

    import lockstep.server.model_loading as model_loading
    import lockstep.server.runtime as runtime

    target_vocab, draft_vocab = {"a": 0, "b": 1}, {"a": 1, "b": 0}

    model = tiny_llama(0, layers=1)

    def fake_load(spec, *args, **kwargs):
        vocab = draft_vocab if spec == "other-draft" else target_vocab
        return SimpleNamespace(name=spec, tokenizer=_Vocab(vocab), model=model, path=spec), None, None

    monkeypatch.setattr(model_loading, "load_audited", fake_load)
    with pytest.raises(ValueError, match="--draft-model other-draft: the draft model's tokenizer differs"):
        runtime.build_runtime(runtime.Options(model="target", draft_model="other-draft"))



# ------------------------------------------------------------ Predicted Outputs

def _predicted(prediction, output, k=4, prompt=(90, 91)):
    """Drafts of a PredictionDrafter after `output` followed `prompt`."""
    from lockstep.server.engine.decoding.drafters import PredictionDrafter

    drafter = PredictionDrafter(prediction, start=len(prompt))
    return drafter.propose([*prompt, *output], k)


def test_a_prediction_is_drafted_from_where_the_output_agrees_with_it():
    prediction = [1, 2, 3, 4, 5, 6, 7, 8]
    assert _predicted(prediction, []) == [1, 2, 3, 4]  # the answer starts as predicted
    assert _predicted(prediction, [1, 2, 3], k=3) == [4, 5, 6]
    assert _predicted(prediction, [1, 2, 3, 4, 5, 6, 7], k=5) == [8]  # up to the prediction's end
    assert _predicted(prediction, [1, 2, 3, 4, 5, 6, 7, 8]) == []  # used up
    assert _predicted(prediction, [1, 2], k=0) == []


def test_after_an_edit_the_prediction_is_found_again_past_it():
    prediction = [1, 2, 3, 4, 5, 6, 7, 8]
    assert _predicted(prediction, [1, 2, 3, 99]) == []  # a word the prediction does not have
    assert _predicted(prediction, [1, 2, 3, 99, 5]) == [6, 7, 8]  # substituted: 4 -> 99
    assert _predicted(prediction, [1, 2, 3, 50, 51, 4]) == [5, 6, 7, 8]  # inserted: 50 51
    assert _predicted(prediction, [1, 2, 6, 7], k=2) == [8]  # deleted: 3 4 5


def test_realignment_prefers_long_matches_and_ignores_far_one_token_ones():
    # 20 21 recurs twice; after the divergence at index 2 the output's "20 21" is nearer at 7
    prediction = [1, 2, 3, 20, 21, 30, 31, 20, 21, 40, 41]
    assert _predicted(prediction, [1, 2, 9, 20, 21], k=2) == [30, 31]  # nearest at or after the edit
    assert _predicted(prediction, [1, 2, 9, 21], k=2) == [30, 31]  # "21" alone, just past the edit
    far = [1, 2, 3, *range(100, 110), 21, 30, 31]
    assert _predicted(far, [1, 2, 9, 21], k=2) == []  # "21" alone, ten tokens past the edit: chance
    assert _predicted(far, [1, 2, 9, 109, 21], k=2) == [30, 31]  # two tokens agree: found again
    # a longer match wins over a nearer shorter one
    prediction = [5, 6, 7, 1, 2, 3, 8, 7, 9]
    assert _predicted(prediction, [4, 6, 7], k=1) == [1]


def test_a_drafter_state_follows_the_output_incrementally():
    from lockstep.server.engine.decoding.drafters import PredictionDrafter

    prediction = [1, 2, 3, 4, 5, 6, 7, 8]
    drafter = PredictionDrafter(prediction, start=1)
    context = [0]
    for step, token in enumerate([1, 2, 3, 99, 5, 6]):
        fresh = PredictionDrafter(prediction, start=1).propose(context, 3)
        assert drafter.propose(context, 3) == fresh, step  # same as from scratch
        context.append(token)
    assert drafter.match(context) == (6, 2) and drafter.propose(context, 3) == [7, 8]


@pytest.mark.parametrize("edit", ["exact", "edited", "unrelated"])
def test_speculation_from_a_prediction_equals_plain_greedy(edit):
    from lockstep.server.engine.decoding.drafters import PredictionDrafter

    target = tiny_llama(0)
    prompt = [3, 14, 15, 92, 65, 35]
    plain = plain_greedy(target, prompt, 16)
    prediction = {"exact": plain, "edited": plain[:5] + [1, 2] + plain[6:], "unrelated": [7] * 16}[edit]
    spec, drafted, accepted = speculative_greedy(target, PredictionDrafter(prediction, len(prompt)), prompt, 16, 5)
    assert spec == plain
    if edit == "exact":
        assert drafted == accepted >= 12  # every draft taken (each pass adds one token of its own)
    elif edit == "edited":
        assert accepted >= 8  # found again past the edit


class LinearRealignment:
    """The re-alignment before the index (issue 49, finding 3): every occurrence of the output's
    last token in the prediction is scanned, so each step costs O(len(prediction)). The
    reference the index must agree with, and the cost it must not have."""

    @staticmethod
    def make(prediction, start, **kw):
        from lockstep.server.engine.decoding.drafters import PredictionDrafter

        class Linear(PredictionDrafter):
            def _realign(self, suffix):
                best, best_key = None, None
                for i, token in enumerate(self.prediction):
                    if not suffix or token != suffix[-1] or i + 1 >= len(self.prediction):
                        continue
                    self.examined += 1
                    end, n = i + 1, 1
                    limit = min(self.max_ngram, i + 1, len(suffix))
                    while n < limit and self.prediction[i - n] == suffix[-1 - n]:
                        n += 1
                    forward = end > self._lost_at
                    if n == 1 and not (forward and end - self._lost_at <= self.window):
                        continue
                    key = (n, forward, -abs(end - self._lost_at))
                    if best_key is None or key > best_key:
                        best, best_key = end, key
                return (best, best_key[0]) if best is not None else (None, 0)

        return Linear(prediction, start, **kw)


def _diverging_walk(drafter, prompt, steps):
    """Feed the drafter an output that keeps leaving the prediction (a logit_bias pushing the
    answer off it): a token of the prediction, then one out of place (a foreign one, or a
    phrase token in the wrong spot), and so on; the positions re-alignment examined at each step."""
    prediction, context, at, per_step = drafter.prediction, list(prompt), 0, []
    for step in range(steps):
        before = drafter.examined
        drafter.propose(context, 4)
        per_step.append(drafter.examined - before)
        if step % 2 == 0:
            context.append(prediction[at])
            at += 1
        else:
            context.append(77 if step % 4 == 1 else prediction[at + 3])
    return per_step


@pytest.mark.parametrize("repeats", [10, 4000])
def test_realignment_examines_a_bounded_number_of_positions_however_long_the_prediction(repeats):
    """Finding 3 of issue 49: a prediction of one phrase repeated, and an output that keeps
    leaving it, made every step scan each occurrence of the last token (~210k positions a step
    for 1 MB). Through the index a step examines at most two positions per suffix length."""
    from lockstep.server.engine.decoding.drafters import PredictionDrafter

    phrase = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    drafter = PredictionDrafter(phrase * repeats, start=2)
    per_step = _diverging_walk(drafter, [90, 91], 40)
    assert max(per_step) <= 2 * drafter.max_ngram, per_step
    assert sum(per_step) > 0  # it did re-align


def test_the_indexed_realignment_drafts_what_the_linear_scan_drafted():
    """The index changes the cost, never the drafts: on random predictions over a small vocabulary
    (every n-gram recurs) and outputs that copy, substitute, insert and delete, every proposal
    and match equals the linear scan's, step by step."""
    import random

    from lockstep.server.engine.decoding.drafters import PredictionDrafter

    rng = random.Random(49)
    for case in range(60):
        vocab = rng.choice([3, 5, 12])
        prediction = [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
        indexed = PredictionDrafter(prediction, start=1, max_ngram=rng.choice([1, 3, 8]), window=rng.choice([2, 8]))
        linear = LinearRealignment.make(prediction, start=1, max_ngram=indexed.max_ngram, window=indexed.window)
        context, at = [99], 0
        for step in range(120):
            drafts = indexed.propose(context, 4)
            assert drafts == linear.propose(context, 4), (case, step)
            assert indexed.match(context) == linear.match(context), (case, step)
            edit = rng.random()
            if edit < 0.6 and at < len(prediction):
                context.append(prediction[at])
                at += 1
            elif edit < 0.75:
                context.append(rng.randrange(vocab + 2))  # substituted or inserted
            else:
                at = rng.randrange(len(prediction) + 1)  # deleted, or moved back
    assert indexed.examined <= linear.examined


def test_speculation_through_the_index_emits_the_tokens_of_the_linear_scan():
    """The answer with the index equals the answer without it (and the plain answer), token for
    token, and so do the drafts, on an ordinary edited prediction."""
    target = tiny_llama(0)
    prompt = [3, 14, 15, 92, 65, 35]
    plain = plain_greedy(target, prompt, 24)
    prediction = plain[:5] + [1, 2] + plain[6:14] + plain[16:]
    from lockstep.server.engine.decoding.drafters import PredictionDrafter

    indexed = speculative_greedy(target, PredictionDrafter(prediction, len(prompt)), prompt, 24, 5)
    linear = speculative_greedy(target, LinearRealignment.make(prediction, len(prompt)), prompt, 24, 5)
    assert indexed == linear and indexed[0] == plain
    assert indexed[2] >= 12  # found again past both edits


def test_a_prediction_makes_the_plan_draft_from_it():
    from lockstep.server.engine.guarantee.decode_plan import RequestRejected, plan_request
    from lockstep.server.engine.guarantee.deployment import Deployment
    from lockstep.server.engine.guarantee.guarantee import Guarantee

    dep = Deployment(guarantee=Guarantee(8, proven=True, shared_passes=True), speculative="prompt_lookup")
    free = plan_request(dep, deterministic=False, speculative=None, num_draft_tokens=None, prediction=True)
    assert (free.method, free.num_draft_tokens) == ("prediction", dep.max_draft_tokens)
    kept = plan_request(dep, deterministic=True, speculative=None, num_draft_tokens=None, prediction=True)
    assert (kept.method, kept.num_draft_tokens, kept.determinism) == ("prediction", 7, "shared")  # k + 1 <= L
    assert plan_request(dep, deterministic=False, speculative=None, num_draft_tokens=3,
                        prediction=True).num_draft_tokens == 3
    assert plan_request(dep, deterministic=False, speculative="none", num_draft_tokens=None,
                        prediction=True).method == "none"
    with pytest.raises(RequestRejected) as refused:
        plan_request(dep, deterministic=False, speculative="prompt_lookup", num_draft_tokens=None, prediction=True)
    assert refused.value.param == "speculative"
    unproven = plan_request(Deployment(guarantee=Guarantee(8)), deterministic=True, speculative=None, num_draft_tokens=None,
                            prediction=True)
    assert (unproven.method, unproven.determinism) == ("none", "alone")
