"""The GPU suite's plumbing (tests/gpu/README.md): its tests are marked `gpu` and run only when
the run asks for them (`-m gpu`, which `make test-gpu` passes); the plain suite collects and
deselects them, so CI's selection is what it was. A run that asks for them where MLX has no
CUDA backend stops at once with one line saying so: these tests never pass or skip there."""
import re

import pytest

NEEDS_CUDA = ("the GPU suite (-m gpu) needs MLX's CUDA backend (mlx-cuda on an NVIDIA GPU); "
              "here MLX runs on {device}: see tests/gpu/README.md")


def gpu_requested(markexpr: str) -> bool:
    """Whether a `-m` expression asks for the gpu tests (`gpu`, `gpu and ...`; not `not gpu`)."""
    return re.search(r"(?<!not )\bgpu\b", markexpr or "") is not None


def cuda_problem() -> str | None:
    """None where MLX's default device is a CUDA GPU, else the line that says it is not."""
    import mlx.core as mx

    if mx.default_device().type == mx.gpu and mx.cuda.is_available():
        return None
    return NEEDS_CUDA.format(device=mx.default_device())


def pytest_collection_modifyitems(config, items):
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    if not gpu_requested(config.option.markexpr):
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
        return
    problem = cuda_problem()
    if problem:
        pytest.exit(problem, returncode=1)
