"""MLX's module directory (kernels/mlx_jit_dir.py): where MLX's CUDA JIT loader reads modules,
by MLX's own rule (mlx/backend/cuda/jit_module.cpp, `ptx_cache_dir`)."""
import mlx.core as mx
import pytest

from lockstep.kernels import mlx_jit_dir


@pytest.mark.parametrize("env, expected", [
    ({"MLX_PTX_CACHE_DIR": "/cache/ptx", "TMPDIR": "/t"}, "/cache/ptx"),
    ({"TMPDIR": "/t", "TMP": "/u"}, "/t/mlx/V/ptx"),
    ({"TEMP": "/w"}, "/w/mlx/V/ptx"),
    ({}, "/tmp/mlx/V/ptx"),
])
def test_the_directory_is_where_mlxs_jit_loader_reads(env, expected, monkeypatch):
    monkeypatch.setattr(mx, "__version__", "0.32.4.dev20261201+abc123")
    assert str(mlx_jit_dir.module_dir(env)) == expected.replace("V", "0.32.4")


def test_the_audits_children_publish_where_kernels_are_launched_by_name(monkeypatch, tmp_path):
    from lockstep.kernels.audit import compile_ahead
    from lockstep.kernels.custom import module_files

    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    short = module_files.write_module("kern", b"cubin")
    assert compile_ahead.kernel_cache_dir() == tmp_path
    assert (tmp_path / f"{module_files.module_name('kern', short)}.ptx").read_bytes() == b"cubin"
