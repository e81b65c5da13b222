"""The prompt cache's disk tier (server/engine/cache/prompt_cache_disk.py, prompt_cache_file.py) and
the byte bounds of both tiers (server/engine/cache/prefix_cache.py).

A "restart" is a second PrefixCache + DiskPromptCache over the same directory (nothing of the
first kept in memory); deterministic answers are compared by token ids and logprob bits with
the same request computed without any cache. Plain requests keep what they prefilled under a
namespace of their own.
"""
import dataclasses
import json
import shutil
import struct

import numpy as np
import pytest

from lockstep.server.engine.guarantee.deployment import Deployment
from lockstep.server.engine.generate import generate
from lockstep.server.engine.cache.prefix_cache import PrefixCache, namespace
from lockstep.server.engine.cache.prompt_cache_disk import BLOCK, DiskPromptCache, block_keys
from lockstep.server.engine.cache.prompt_cache_file import encode
from lockstep.server.engine.guarantee.decode_plan import plan_request
from lockstep.server.engine.decoding.request_state import GenerationRequest
from lockstep.server.engine.decoding.sampling import SamplingParams
from tests.deterministic_fixtures import float_bits

CHUNK = 2 * BLOCK  # rows are not canonical here (no invariance installed): whole chunks only go to disk
DEPLOYMENT = Deployment(fingerprint="fp_disk_tier_test", prefill_chunk=CHUNK)
TEXT = ("The river flows past the old mill, where the miller counts his sacks of grain each evening. "
        "Lanterns swing from the bridge and children race paper boats beneath it. ")


@pytest.fixture(scope="module")
def prompts(embedded_model):
    ids = embedded_model.tokenizer.encode(TEXT * 20)
    first = ids[:CHUNK * 2 + BLOCK + 10]  # two whole chunks and a partial one holding a whole block
    return first, first + ids[len(first):CHUNK * 4 + 20]  # the next "turn" extends it


def run(loaded, prompt, cache=None, deployment=DEPLOYMENT, *, plain=False):
    """(token ids, logprob bits, cached tokens) of a deterministic request (`plain`: a plain one)."""
    plan = plan_request(deployment, deterministic=not plain, speculative=None, num_draft_tokens=None)
    request = GenerationRequest(prompt_tokens=prompt, max_tokens=6,
                                sampling=SamplingParams(temperature=0.0, seed=1, top_logprobs=2))
    deltas = [d for d in generate(loaded, request, plan=plan, deployment=deployment, prefix_cache=cache)
              if d is not None]
    final = deltas[-1]
    bits = [float_bits(item.logprob) for d in deltas for item in d.logprobs]
    return final.token_ids, bits, final.cached_tokens


def restarted(root, **kw):
    return PrefixCache(4, disk=DiskPromptCache(root, kw.pop("max_bytes", 1 << 30)), **kw)


@pytest.fixture(scope="module")
def cold(embedded_model, prompts):
    return run(embedded_model, prompts[1])


@pytest.fixture(scope="module")
def written(embedded_model, prompts, tmp_path_factory):
    """The first prompt's whole chunks on disk, written by a first 'process' (once a module)."""
    root = tmp_path_factory.mktemp("written")
    first = restarted(root)
    run(embedded_model, prompts[0], first)
    first.disk.flush()
    return root, first.disk


@pytest.fixture()
def stored(written, tmp_path):
    """A copy of `written`'s directory, for a test to read or damage."""
    shutil.copytree(written[0], tmp_path / "kv")
    return tmp_path / "kv", written[1]


def test_only_whole_chunks_go_to_disk_where_rows_are_not_canonical(stored, prompts):
    _, disk = stored
    # the first prompt's prefill covers 2 chunks and a whole block more: its partial chunk ran in
    # a narrower call than a longer prompt runs it, so only the 2 whole chunks' blocks are kept
    assert len(prompts[0]) - 1 >= 2 * CHUNK + BLOCK
    assert disk.blocks_written == 2 * CHUNK // BLOCK and disk.stats()["files"] == 4


def test_a_restart_finds_the_prefix_on_disk_and_answers_bit_identically(embedded_model, stored, prompts, cold):
    root, _ = stored
    second = restarted(root)
    tokens, bits, cached = run(embedded_model, prompts[1], second)
    assert second.disk_hits == 1 and second.disk.blocks_read == 4 and cached == 2 * CHUNK
    assert (tokens, bits) == cold[:2]
    # memory holds that prompt now: the same request again does not read the disk
    assert run(embedded_model, prompts[1], second)[2] >= 2 * CHUNK and second.disk.blocks_read == 4


def test_a_plain_conversation_keeps_what_it_prefilled_under_its_own_namespace(embedded_model, prompts, tmp_path, cold):
    """The next turn of a plain conversation resumes where the first prompt ends (mid-chunk),
    so its KV is not what a cold prefill writes: every whole block of it goes to disk under the
    plain requests' namespace, which a restarted plain request reads whole, and a deterministic
    one never (it answers as cold)."""
    first = restarted(tmp_path)
    run(embedded_model, prompts[0], first, plain=True)
    assert run(embedded_model, prompts[1], first, plain=True)[2] == len(prompts[0]) - 1  # resumed where it ended
    first.disk.flush()
    assert first.disk.blocks_written == (len(prompts[1]) - 1) // BLOCK
    second = restarted(tmp_path)
    tokens, bits, cached = run(embedded_model, prompts[1], second)
    assert cached == 0 and second.disk_hits == 0 and (tokens, bits) == cold[:2]
    third = restarted(tmp_path)
    assert run(embedded_model, prompts[1], third, plain=True)[2] == (len(prompts[1]) - 1) // BLOCK * BLOCK
    assert third.disk_hits == 1


def test_a_plain_prompts_smaller_chunks_go_to_disk_under_the_plain_namespace(embedded_model, prompts, tmp_path):
    """KV a plain prompt wrote in chunks smaller than --prefill-chunk goes to disk under the
    plain requests' namespace: found after a restart by a plain request (here, resuming on its
    grid, the same bits as without the cache), never by a deterministic one."""
    plain = dataclasses.replace(DEPLOYMENT, plain_prefill_chunk=BLOCK)
    cold_plain = run(embedded_model, prompts[1], deployment=plain, plain=True)
    first = restarted(tmp_path)
    run(embedded_model, prompts[0], first, deployment=plain, plain=True)
    first.disk.flush()
    assert first.disk.blocks_written == (len(prompts[0]) - 1) // BLOCK  # every whole block of its grid
    second = restarted(tmp_path)
    tokens, bits, cached = run(embedded_model, prompts[1], second, deployment=plain, plain=True)
    assert second.disk_hits == 1 and cached == first.disk.blocks_written * BLOCK
    assert (tokens, bits) == cold_plain[:2]
    # the disk hit is in memory now, marked not canonical: a deterministic lookup finds none
    assert second.find(prompts[1][:-1], namespace(plain), canonical_only=True) is None
    third = restarted(tmp_path)
    assert run(embedded_model, prompts[1], third)[2] == 0 and third.disk_hits == 0  # the canonical namespace's: none


def _rewrite_block(path, change):
    """Apply `change` to a block's first tensor and store it with a matching checksum: an entry
    verification cannot tell from a real one (what serving without verification would load)."""
    data = path.read_bytes()
    (size,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8:8 + size])
    meta = header.pop("__metadata__")
    layers = []
    for i in range(len(header) // 2):
        pair = []
        for n in ("keys", "values"):
            spec = header[f"{i}.{n}"]
            lo, hi = spec["data_offsets"]
            pair.append(np.frombuffer(data[8 + size + lo:8 + size + hi], np.float32).reshape(spec["shape"]).copy())
        layers.append(pair)
    change(layers[0][0])
    path.write_bytes(encode(meta["key"], "F32", [tuple(p) for p in layers]))


def test_negative_control_an_altered_block_that_passes_verification_changes_the_answer(
        embedded_model, stored, prompts, cold):
    root, _ = stored
    for path in root.glob("*.safetensors"):
        _rewrite_block(path, lambda keys: keys.__iadd__(0.5))
    tokens, bits, cached = run(embedded_model, prompts[1], restarted(root))
    assert cached == 2 * CHUNK and bits != cold[1]  # the comparison above can see KV that is not exact


def _damage(root, keys, victim, how):
    path = root / f"{victim}.safetensors"
    data = path.read_bytes()
    if how == "flip":
        path.write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
    elif how == "truncate":
        path.write_bytes(data[:len(data) // 2])
    elif how == "garbage":
        path.write_bytes(b"\xff" * 64)
    else:  # a whole, valid entry under another block's name
        path.write_bytes((root / f"{keys[0]}.safetensors").read_bytes())
    return path


def test_a_damaged_block_is_dropped_and_its_prefix_computed_again(embedded_model, stored, prompts, cold):
    root, _ = stored
    ns = namespace(DEPLOYMENT)
    keys = block_keys(ns, prompts[0][:-1])
    _damage(root, keys, keys[2], "flip")
    second = restarted(root)
    tokens, bits, cached = run(embedded_model, prompts[1], second)
    assert (tokens, bits) == cold[:2]
    assert second.disk.damaged == 1 and cached == 2 * BLOCK  # the blocks before the damaged one
    # the request stored its own prompt's whole chunks again: the dropped block is back, intact
    second.disk.flush()
    again = restarted(root).disk
    assert len(again.lookup(ns, prompts[1][:-1], 30)[1]) == (len(prompts[1]) - 1) // CHUNK * CHUNK // BLOCK
    assert again.damaged == 0


@pytest.mark.parametrize("how", ["truncate", "garbage", "other_key"])
def test_other_damage_is_dropped_on_read_too(embedded_model, stored, prompts, how):
    root, _ = stored
    ns = namespace(DEPLOYMENT)
    keys = block_keys(ns, prompts[0][:-1])
    path = _damage(root, keys, keys[1], how)
    disk = DiskPromptCache(root, 1 << 30)
    dtype, blocks = disk.lookup(ns, prompts[0][:-1], 30)
    assert dtype == "F32" and len(blocks) == 1 and disk.damaged == 1 and not path.exists()


def test_another_fingerprint_never_reads_the_files(embedded_model, stored, prompts, cold):
    root, _ = stored
    other = Deployment(fingerprint="fp_another_model", prefill_chunk=CHUNK)
    second = restarted(root)
    assert run(embedded_model, prompts[1], second, deployment=other)[2] == 0 and second.disk.blocks_read == 0


def test_the_disk_tier_stays_under_its_byte_bound_evicting_least_recently_used(embedded_model, prompts, tmp_path):
    one = restarted(tmp_path)
    run(embedded_model, prompts[0], one)
    one.disk.flush()
    block_bytes = max(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    files = sorted(tmp_path.glob("*.safetensors"))
    bound = 3 * block_bytes
    small = PrefixCache(0, disk=DiskPromptCache(tmp_path, bound))  # a restart under a smaller bound
    assert small.disk.bytes <= bound and len(list(tmp_path.glob("*.safetensors"))) == 3
    # another prompt's blocks push the least recently used out, never past the bound
    other = embedded_model.tokenizer.encode("Snow fell on the quiet harbour town. " * 40)[:CHUNK + 5]
    run(embedded_model, other, small)
    small.disk.flush()
    left = sorted(tmp_path.glob("*.safetensors"))
    assert small.disk.bytes <= bound and sum(p.stat().st_size for p in left) <= bound
    assert small.disk.blocks_written == 2 and len(left) == 3 and len(set(left) & set(files)) == 1


def test_a_full_write_queue_drops_the_write_and_never_blocks(tmp_path):
    import threading

    disk = DiskPromptCache(tmp_path, 1 << 30, queue_entries=1)
    layers = [(np.zeros((1, 1, BLOCK, 2), np.float32),) * 2]
    results = []
    with disk._lock:  # the writer thread cannot finish a write meanwhile
        submitter = threading.Thread(target=lambda: results.extend(
            disk.submit("ns", list(range(BLOCK)), "F32", layers) for _ in range(3)))
        submitter.start()
        submitter.join(timeout=60)  # a hang guard: submit never waits for the writer
        assert not submitter.is_alive()
    # at most one went to the writer and one waits in the queue: the third is dropped
    assert results[-1] is False and disk.dropped >= 1
    disk.flush()


def test_the_memory_tier_stays_under_its_byte_bound(embedded_model, prompts):
    cache = PrefixCache(8)
    run(embedded_model, prompts[0], cache)
    one = cache.bytes
    bounded = PrefixCache(8, max_bytes=one + one // 2)
    run(embedded_model, prompts[0], bounded)
    run(embedded_model, prompts[0][5:], bounded)  # a second entry of the same size: the first goes
    assert 0 < bounded.bytes <= one + one // 2 and len(bounded._store) == 1


# ------------------------------------------------------------------------------ over HTTP

def test_cached_tokens_over_http_come_from_disk_after_a_restart(embedded_model, tmp_path):
    from openai import OpenAI

    from lockstep.server.api.app import create_app
    from lockstep.server.engine import Engine
    from tests.http_server import running

    messages = [{"role": "user", "content": TEXT * 3}]
    answers = []
    for process in range(2):  # the second engine starts with nothing in memory
        cache = restarted(tmp_path)
        engine = Engine(embedded_model, max_active=2, deployment=DEPLOYMENT, prefix_cache=cache).start()
        try:
            with running(create_app(engine)) as url:
                client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
                r = client.chat.completions.create(model="default", messages=messages, max_tokens=3, temperature=0)
                answers.append((r.usage.prompt_tokens_details.cached_tokens, r.choices[0].message.content))
        finally:
            engine.stop()  # waits for the queued disk writes
    prompt = r.usage.prompt_tokens
    assert prompt > CHUNK and answers[0][0] == 0
    # a plain request's every whole block (its bits are not guaranteed: the text is not compared)
    assert answers[1][0] == (prompt - 1) // BLOCK * BLOCK and cache.disk_hits == 1 and answers[1][1]


def test_a_deterministic_request_over_http_is_bit_identical_with_its_prefix_from_disk(embedded_model, tmp_path):
    """Under the guarantee (L = 8, chunk 4: rows canonical), every whole block of the prompt
    goes to disk, and a second server on the directory answers with the same bits."""
    from tests.http_server import deterministic_server

    messages = [{"role": "user", "content": TEXT * 2}]
    answers = []
    for process in range(2):
        cache = restarted(tmp_path)
        with deterministic_server(embedded_model, 8, prefill_chunk=4, prefix_cache=cache,
                                  fingerprint="fp_disk_tier_det") as (client, engine):
            assert "canonical=1" in namespace(engine.deployment)
            r = client.chat.completions.create(model="default", messages=messages, max_tokens=4, temperature=0,
                                               logprobs=True, top_logprobs=2, extra_body={"deterministic": True})
            answers.append((r.usage.prompt_tokens_details.cached_tokens,
                            [(t.token, float_bits(t.logprob)) for t in r.choices[0].logprobs.content]))
            cache.flush()
    prompt = r.usage.prompt_tokens
    assert answers[0][0] == 0 and answers[1][0] == (prompt - 1) // BLOCK * BLOCK > 0 and cache.disk_hits == 1
    assert answers[1][1] == answers[0][1]


def test_serve_flags_build_the_tiers_and_an_unusable_dir_is_memory_only(tmp_path, caplog):
    import argparse

    from lockstep.server.commands.serve import add_arguments, prompt_cache_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--prompt-cache-dir", str(tmp_path / "kv"), "--prompt-cache-bytes", "512M",
                              "--prompt-cache-disk-bytes", "1.5G"])
    cache = prompt_cache_from_args(args)
    assert cache.max_bytes == 512 << 20 and cache.disk.max_bytes == 3 << 29 and cache.disk.root == tmp_path / "kv"
    assert prompt_cache_from_args(parser.parse_args([])).disk is None  # off by default
    (tmp_path / "file").write_text("")
    cache = prompt_cache_from_args(parser.parse_args(["--prompt-cache-dir", str(tmp_path / "file")]))
    assert cache.disk is None and "memory only" in caplog.text
    with pytest.raises(SystemExit):
        parser.parse_args(["--prompt-cache-bytes", "lots"])


def test_a_stopping_engine_keeps_the_queued_disk_writes(embedded_model, tmp_path):
    import threading

    from lockstep.server.engine import Engine

    release = threading.Event()

    class HeldWriter(DiskPromptCache):
        """Its writer holds each write until someone flushes."""

        def _write(self, *item):
            release.wait(timeout=120)
            super()._write(*item)

        def flush(self, timeout=None):
            release.set()
            return super().flush(timeout)

    disk = HeldWriter(tmp_path, 1 << 30)
    engine = Engine(embedded_model, max_active=1, prefix_cache=PrefixCache(1, disk=disk)).start()
    layers = [(np.zeros((1, 1, BLOCK, 2), np.float32),) * 2]
    assert disk.submit("ns", list(range(BLOCK)), "F32", layers)
    engine.stop()
    try:
        assert disk._queue.unfinished_tasks == 0 and disk.blocks_written == 1
    finally:
        release.set()
