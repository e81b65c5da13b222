"""Self-test proofs kept per machine: re-used only for the same model, strategy, L, code,
MLX and device; never across a test double; a corrupt entry is proven again."""
import json
import logging

import pytest

from tests.doubles.shape_variant import shape_variant_backend
from lockstep.kernels.invariance import set_batch_invariant_limit
from lockstep.kernels.invariance.selftest import ProofCache, proof_key, self_test
from lockstep.kernels.verdict_cache import VerdictCache
from tests.tiny_models import tiny_llama

PREFIXES = (7,)


@pytest.fixture
def store(tmp_path):
    return VerdictCache("selftest", tmp_path)


@pytest.fixture
def model():
    return tiny_llama()


def proofs(store, weights="digest-a", fresh=False):
    return ProofCache(store, {"weights": weights, "transform": "weights=float32"}, fresh)


@pytest.mark.reference_blas
def test_a_proof_is_reused_on_a_restart(model, store):
    first = self_test(model, 4, prefixes=PREFIXES, proof_cache=proofs(store))
    again = self_test(model, 4, prefixes=PREFIXES, proof_cache=proofs(store))
    assert first.passed and not first.cached
    assert again.passed and again.cached and again.widths == first.widths == (2, 3, 4)
    assert len(list(store.dir.glob("*.json"))) == 1
    assert not self_test(model, 4, prefixes=PREFIXES, proof_cache=proofs(store, fresh=True)).cached


@pytest.mark.parametrize("change", ["weights", "limit", "prefixes", "seed"])
def test_anything_the_proof_depends_on_is_a_new_key(model, store, change):
    self_test(model, 4, prefixes=PREFIXES, proof_cache=proofs(store))
    kwargs = {"prefixes": PREFIXES, "proof_cache": proofs(store)}
    limit = 4
    if change == "weights":
        kwargs["proof_cache"] = proofs(store, weights="digest-b")
    elif change == "limit":
        limit = 3
    elif change == "prefixes":
        kwargs["prefixes"] = (8,)
    else:
        kwargs["seed"] = 1
    assert not self_test(model, limit, **kwargs).cached


def test_the_installed_strategy_is_part_of_the_key(model, store):
    rowwise = set_batch_invariant_limit(model, 3, "rowwise", prefixes=PREFIXES,
                                        proof_cache=proofs(store))
    native = set_batch_invariant_limit(model, 3, "native", prefixes=PREFIXES,
                                       proof_cache=proofs(store))
    assert not rowwise.self_test.cached and not native.self_test.cached
    again = set_batch_invariant_limit(model, 3, "rowwise", prefixes=PREFIXES,
                                      proof_cache=proofs(store))
    assert again.self_test.cached and again.guaranteed and again.strategy == "rowwise"
    set_batch_invariant_limit(model, 0)


def test_key_names_backend_mlx_code_and_ops(model):
    key = proof_key(model, 4, (2, 3, 4), PREFIXES, 0, True, {"weights": "w"})
    assert {"mlx", "backend", "device", "blas"} <= set(key["environment"])
    assert key["code"] and key["model"] == {"weights": "w"}
    with shape_variant_backend():
        assert proof_key(model, 4, (2, 3, 4), PREFIXES, 0, True, {"weights": "w"})["ops"] != key["ops"]


@pytest.mark.reference_blas
def test_a_double_never_reuses_a_real_proof_and_failures_stay_failures(model, store):
    assert self_test(model, 4, prefixes=PREFIXES, proof_cache=proofs(store)).passed
    with shape_variant_backend():
        failed = self_test(model, 4, prefixes=PREFIXES, proof_cache=proofs(store))
        again = self_test(model, 4, prefixes=PREFIXES, proof_cache=proofs(store))
    assert not failed.passed and not failed.cached
    assert not again.passed and again.cached and again.mismatches == failed.mismatches


@pytest.mark.reference_blas
@pytest.mark.parametrize("damage", ["not json", "passed with mismatches", "passed not a bool"])
def test_a_corrupt_proof_is_proven_again(model, store, caplog, damage):
    self_test(model, 4, prefixes=PREFIXES, proof_cache=proofs(store))
    (path,) = store.dir.glob("*.json")
    record = json.loads(path.read_text())
    if damage == "not json":
        path.write_text("{ truncated")
    else:
        record["value"]["passed"] = True if damage == "passed with mismatches" else "yes"
        record["value"]["mismatches"] = [{"prefix": 7, "width": 2, "row": 0, "what": "logits",
                                          "max_abs_diff": 1.0}]
        path.write_text(json.dumps(record))
    with caplog.at_level(logging.WARNING):
        result = self_test(model, 4, prefixes=PREFIXES, proof_cache=proofs(store))
    assert result.passed and not result.cached
    assert "cache" in caplog.text
    assert self_test(model, 4, prefixes=PREFIXES, proof_cache=proofs(store)).cached
