"""The prefill grid (kernels/invariance/prefill.py): where a prompt's chunks end, where a cached
prefix resumes, and how much of a prefill any longer prompt computes the same.

The rule the prefix cache relies on: whatever two prompts' lengths, a point where one resumes
over the other's entry (at most that entry's `exact_length`) is preceded by the same chunks in
both, so the cached KV is what its own cold prefill writes. Where a prompt may be cut anywhere
(`split_rows`, proven at startup), the rule is another: every chunk holds at least that many
rows, so every position's KV is what any prefill writes."""
import pytest

from lockstep.kernels.invariance.prefill import (SMALLEST_CHUNK, chunk_end, exact_length, free_splits, resume_at,
                                                whole_chunks_are_canonical)


def chunks(n: int, chunk: int, start: int = 0, split_rows: int = 0) -> list[tuple[int, int]]:
    out, pos = [], start
    while pos < n:
        end = chunk_end(pos, n, chunk, split_rows=split_rows)
        out.append((pos, end))
        pos = end
    return out


@pytest.mark.parametrize("chunk", [8, 64, 128, 512])
def test_chunks_cover_the_prompt_and_stay_within_a_chunk(chunk):
    for n in range(1, 3 * chunk + 40):
        parts = chunks(n, chunk)
        assert parts[0][0] == 0 and parts[-1][1] == n
        assert all(a < b <= a + chunk for a, b in parts)
        assert all(b == c for (_, b), (c, _) in zip(parts, parts[1:]))
        # no chunk below one chunk's end leaves a sliver after it
        assert all(n - b >= SMALLEST_CHUNK for _, b in parts[:-1] if b < chunk)


def test_a_short_prompt_is_split_on_the_halving_points():
    assert chunks(100, 512) == [(0, 16), (16, 32), (32, 64), (64, 100)]
    assert chunks(40, 512) == [(0, 16), (16, 40)]  # 32 would leave 8 tokens: they join the chunk before
    assert chunks(1100, 512)[-3:] == [(256, 512), (512, 1024), (1024, 1100)]
    assert chunks(20, 8) == [(0, 8), (8, 16), (16, 20)]  # no halving points below 2 × 16


@pytest.mark.parametrize("chunk", [64, 128, 512])
def test_a_resume_point_is_preceded_by_the_same_chunks_as_a_cold_prefill(chunk):
    """For an entry of any length and a prompt of any length sharing it, the point the prompt
    resumes at (within the entry's exact length) ends one of the prompt's own chunks, and the
    chunks before it are the entry's."""
    top = chunk + 80
    plans = {n: chunks(n, chunk) for n in range(1, top)}
    for written, theirs in plans.items():
        exact = exact_length(written, chunk, 0)
        assert exact <= written
        for n, own in plans.items():
            at = resume_at(min(exact, n), chunk, 0, n)
            assert at <= min(exact, n)
            assert at in (0, n) or any(b == at for _, b in own)
            assert [c for c in own if c[1] <= at] == [c for c in theirs if c[1] <= at]


def test_canonical_rows_resume_anywhere():
    assert resume_at(37, 512, 512, 100) == 37
    assert exact_length(37, 512, 512) == 37
    assert resume_at(37, 512, 8, 100) == 32
    assert resume_at(37, 512, 8, 45) == 16  # 32 does not end a chunk of a 45-token prompt


def test_whole_chunks_are_the_grids_only_where_it_has_no_point_below_a_chunk_or_rows_are_canonical():
    """A plain request's whole chunks (`halving=False`) skip the narrow ones; its KV then counts
    as canonical only where that changes nothing."""
    assert [chunk_end(p, 100, 512, halving=False) for p in (0, 37)] == [100, 100]
    assert chunk_end(0, 100, 512) == 16
    assert not whole_chunks_are_canonical(512, 8)
    assert whole_chunks_are_canonical(512, 512)  # every row its solo bits: any split writes the same
    assert whole_chunks_are_canonical(31, 0)  # no grid point below a chunk of 31
    for chunk in (8, 31):
        assert all(chunk_end(p, n, chunk) == chunk_end(p, n, chunk, halving=False)
                   for n in range(1, 100) for p in range(n))


SPLIT = 16


@pytest.mark.parametrize("chunk", [32, 64, 128, 512])
def test_where_a_prompt_may_be_cut_anywhere_every_chunk_keeps_the_proven_rows(chunk):
    """A cold prefill, or one resumed over any cached length, runs chunks of at least SPLIT
    rows and at most a chunk (a prompt shorter than SPLIT: one chunk from 0); it resumes where
    its hit ends unless fewer than SPLIT tokens would follow, and a prefill's KV is exact
    throughout (none of a prompt shorter than SPLIT)."""
    for n in range(1, 2 * chunk + 40):
        assert exact_length(n, chunk, 0, SPLIT) == (n if n >= SPLIT else 0)
        for cached in range(n + 1):
            at = resume_at(cached, chunk, 0, n, SPLIT)
            assert at <= cached
            if n < SPLIT:
                assert at == 0
                continue
            assert at == (cached if n - cached >= SPLIT or cached == n else n - SPLIT)
            parts = chunks(n, chunk, at, SPLIT)
            assert all(SPLIT <= b - a <= chunk for a, b in parts)
            assert not parts or (parts[0][0] == at and parts[-1][1] == n)


def test_cuts_anywhere_need_room_for_two_pieces_in_a_chunk():
    assert free_splits(SPLIT, 32) == SPLIT and free_splits(SPLIT, 31) == 0 and free_splits(0, 512) == 0
    assert chunks(100, 512, split_rows=SPLIT) == [(0, 100)]  # no narrow chunks before the first 512
    assert chunks(520, 512, split_rows=SPLIT) == [(0, 504), (504, 520)]  # the last keeps 16 rows
    assert resume_at(40, 512, 0, 59, SPLIT) == 40 and resume_at(50, 512, 0, 59, SPLIT) == 43
    assert whole_chunks_are_canonical(512, 8, SPLIT) and not whole_chunks_are_canonical(512, 8)
    for n in range(1, 100):  # no room: the grid, as if nothing were proven
        assert chunks(n, 31, split_rows=SPLIT) == chunks(n, 31)
        assert all(resume_at(c, 31, 0, n, SPLIT) == resume_at(c, 31, 0, n) for c in range(n + 1))
