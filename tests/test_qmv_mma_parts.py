"""kernels/custom/qmv_mma_parts.py on a CPU, where it cannot run: which layers may share a
launch (only parts split across the same warps as on their own, the one launch setting that
is part of a row's order), that every part's column tiles are launched, and that each
instance's source calls the parts kernel with each part's arrays. The GPU agreement (each part
equal to its layer's own qmv_mma call, bit for bit) is its smoke test's, run at startup."""
import mlx.core as mx
import pytest

from lockstep.kernels.custom import qmv_mma, qmv_mma_parts

EIGHT_B = ((4096, 1024, 1024), (14336, 14336))  # q/k/v and gate/up of Llama-3-8B


def test_parts_share_a_launch_only_where_they_split_k_alike():
    assert all(qmv_mma_parts.shares_order(ns, 4096) for ns in EIGHT_B)
    assert qmv_mma_parts.shares_order((4096, 4096, 4096), 4096)  # 12288 together: each still its own warps
    assert not qmv_mma_parts.shares_order((4096, 14336), 4096)  # 8 warps and 4
    assert not qmv_mma_parts.shares_order((4096,), 4096)
    assert not qmv_mma_parts.shares_order((64, 64, 64, 64), 4096)


@pytest.mark.parametrize("m", [1, 8, 16, 17, 40])
@pytest.mark.parametrize("ns", EIGHT_B + ((4096, 4096, 4096), (40, 8, 24)))
def test_a_launch_covers_every_parts_tiles_in_each_parts_own_order(m, ns):
    plan = qmv_mma_parts._launch_plan(m, ns, 4096, "nvfp4", 16, mx.bfloat16)
    template = dict(plan["template"])
    for n in ns:  # WARPS is part of a row's order: each part's own call's
        assert template["WARPS"] == dict(qmv_mma._launch_plan(m, n, 4096, "nvfp4", 16, mx.bfloat16)["template"])["WARPS"]
    groups = max(template["CG"], 1)  # the staged tile's column groups a block (2..16 rows)
    assert template["CG"] == qmv_mma.column_groups(sum(ns), 4096, m)
    cols = 8 * template["NT"] * groups
    assert plan["grid"][0] == sum(-(-n // cols) for n in ns) * 32 * template["WARPS"] * groups
    assert plan["threadgroup"] == (32 * template["WARPS"] * groups, 1, 1)
    assert plan["grid"][1] * template["ROWS"] >= m > (plan["grid"][1] - 1) * template["ROWS"]
    assert plan["output_shapes"] == [(m, n) for n in ns] and plan["output_dtypes"] == [mx.bfloat16] * len(ns)


@pytest.mark.parametrize("mode", ["affine", "nvfp4"])
@pytest.mark.parametrize("parts", [2, 3])
def test_each_instance_calls_the_parts_kernel_with_each_parts_arrays(mode, parts):
    body = "affine" if mode == "affine" else "fp"
    family = qmv_mma_parts.family(body, parts)
    assert family.scalar_names == ("M", "K") + tuple(f"N{i}" for i in range(parts))
    assert [n for n, _ in family.outputs] == [f"y{i}" for i in range(parts)]
    plan = qmv_mma_parts._launch_plan(1, EIGHT_B[0][:parts], 4096, mode, 64 if mode == "affine" else 16, mx.float16)
    source = family.source(tuple(plan["template"]))
    call = source[source.index("lockstep_qmma::qmv_mma_parts<T"):].split(";")[0]
    for i in range(parts):
        assert f"w{i}, " in call and f"y{i}, N{i}" in call
        assert (f"s{i}, nullptr, b{i}" if mode == "affine" else f"nullptr, s{i}, nullptr") in call
    assert call.count("nullptr, nullptr, nullptr, nullptr, nullptr, 0") == 3 - parts  # an absent third part
    assert "__device__ void qmv_mma_parts" in source


def test_a_block_runs_its_parts_tile_through_the_one_copy_of_the_tile():
    # blocks 0 .. t0 - 1 part 0's tiles, then part 1's, then part 2's (the grid above): the GPU
    # suite proves the bits; this, that the kernel keeps that mapping with one tile call
    text = qmv_mma.SOURCE.read_text()
    body = text[text.index("__device__ void qmv_mma_parts("):]
    body = body[:body.index("\n}\n")]
    assert "const int t0 = (N0 + COLS - 1) / COLS, t1 = (N1 + COLS - 1) / COLS;" in body
    assert "const bool first = tile < t0, second = !first && tile < t0 + t1;" in body
    assert "if (!first && !second && N2 == 0) return;" in body
    assert "tile -= first ? 0 : second ? t0 : t0 + t1;" in body
    assert body.count("qmv_mma_any_tile<") == 1


def test_the_cpu_has_no_parts_launch():
    assert "CUDA" in qmv_mma_parts.unavailable_reason("nvfp4", mx.bfloat16)
    assert qmv_mma_parts.launch_for((1, 1), (4096, 1024, 1024), 4096, "nvfp4", 4, 16, mx.bfloat16, mx.uint32, 512,
                                    mx.uint8, None) is None
