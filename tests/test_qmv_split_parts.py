"""kernels/custom/qmv_split_parts.py on a CPU, where it cannot run: that the grid's blocks are
dealt so that every part's every column group is taken by exactly one block, that the launch
keeps qmv_split's instance settings, and that each instance's source calls the parts kernel
with each part's arrays. The GPU agreement (each part equal to its layer's own qmv_split call,
bit for bit) is its smoke test's, run at startup."""
import mlx.core as mx
import pytest

from lockstep.kernels.custom import qmv_split, qmv_split_parts

EIGHT_B = ((4096, 1024, 1024), (14336, 14336))  # q/k/v and gate/up of Llama-3-8B


def columns_taken(ns, columns: int, grid: int) -> list[list[int]]:
    """Which columns each part's blocks write, walking as qmv_split_share does: block b of a
    part's B takes column groups b, b + B, ... (C columns each, those past N never stored)."""
    taken = [[] for _ in ns]
    for part, (n, blocks) in enumerate(zip(ns, qmv_split_parts.part_blocks(ns, columns, grid))):
        for block in range(blocks):
            n0 = block * columns
            while n0 < n:
                taken[part] += [c for c in range(n0, n0 + columns) if c < n]
                n0 += blocks * columns
    return taken


@pytest.mark.parametrize("ns", EIGHT_B + ((40, 8, 24), (70, 33, 9), (8, 2050, 1030), (1030, 520), (9, 5000)))
@pytest.mark.parametrize("cap", [None, 5, 7, 100])
def test_every_column_of_every_part_is_written_once(ns, cap):
    columns = qmv_split.block_columns(sum(ns))
    grid = qmv_split_parts.grid_blocks(ns, columns, cap)
    blocks = qmv_split_parts.part_blocks(ns, columns, grid)
    assert sum(blocks) == grid and min(blocks) >= 1
    assert grid <= max(cap or qmv_split.MAX_BLOCKS, len(ns))
    for n, taken in zip(ns, columns_taken(ns, columns, grid)):
        assert sorted(taken) == list(range(n))


def test_blocks_follow_the_parts_sizes():
    assert qmv_split_parts.part_blocks((4096, 1024, 1024), 4, 660) == (440, 110, 110)
    assert qmv_split_parts.part_blocks((14336, 14336), 4, 660) == (330, 330)
    assert qmv_split_parts.part_blocks((4, 4, 4), 4, 3) == (1, 1, 1)


@pytest.mark.parametrize("m", [1, 3, 4, 9])
@pytest.mark.parametrize("ns", EIGHT_B)
def test_a_launch_has_qmv_splits_settings_and_one_output_a_part(m, ns):
    plan = qmv_split_parts._launch_plan(m, ns, "nvfp4", 16, mx.bfloat16)
    own = qmv_split._launch_plan(m, sum(ns), "nvfp4", 16, mx.bfloat16)
    assert plan["template"] == own["template"]  # C and MR: which block computes a column, never its order
    assert plan["grid"][1:] == own["grid"][1:] and plan["threadgroup"] == own["threadgroup"]
    assert plan["output_shapes"] == [(m, n) for n in ns] and plan["output_dtypes"] == [mx.bfloat16] * len(ns)


@pytest.mark.parametrize("mode", ["affine", "nvfp4"])
@pytest.mark.parametrize("parts", [2, 3])
def test_each_instance_calls_the_parts_kernel_with_each_parts_arrays(mode, parts):
    body = "affine" if mode == "affine" else "fp"
    family = qmv_split_parts.family(body, parts)
    assert family.scalar_names == ("M", "K") + tuple(f"N{i}" for i in range(parts))
    assert [n for n, _ in family.outputs] == [f"y{i}" for i in range(parts)]
    plan = qmv_split_parts._launch_plan(1, EIGHT_B[0][:parts], mode, 64 if mode == "affine" else 16, mx.float16)
    source = family.source(tuple(plan["template"]))
    call = source[source.index("lockstep_qsplit::qmv_split_parts<T"):].split(";")[0]
    for i in range(parts):
        assert f"w{i}, " in call and f"y{i}, N{i}" in call
        assert (f"s{i}, nullptr, b{i}" if mode == "affine" else f"nullptr, s{i}, nullptr") in call
    assert call.count("nullptr, nullptr, nullptr, nullptr, nullptr, 0") == 3 - parts  # an absent third part
    assert "__device__ void qmv_split_parts" in source


def test_the_cpu_has_no_parts_launch():
    assert "CUDA" in qmv_split_parts.unavailable_reason("nvfp4", mx.bfloat16)
    assert qmv_split_parts.launch_for((1, 1), (4096, 1024, 1024), 4096, "nvfp4", 4, 16, mx.bfloat16, mx.uint32, 512,
                                      mx.uint8, None) is None
    assert not qmv_split_parts.takes_parts((4096,)) and not qmv_split_parts.takes_parts((8, 8, 8, 8))
