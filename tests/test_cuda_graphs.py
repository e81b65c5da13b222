"""kernels/cuda_graphs.py: the launch mode MLX's CUDA backend reads from MLX_USE_CUDA_GRAPHS."""
import os
import subprocess
import sys

import pytest

from lockstep.kernels import cuda_graphs


def test_auto_keeps_the_environment_and_mlx_defaults():
    assert cuda_graphs.resolve("auto") is None
    assert cuda_graphs.resolve("on") == "1"
    assert cuda_graphs.resolve("off") == "0"
    with pytest.raises(ValueError):
        cuda_graphs.resolve("sometimes")


@pytest.mark.parametrize("flag, preset, expected", [(None, None, "None"), (None, "0", "0"),
                                                        ("on", "0", "1"), ("off", None, "0")])
def test_the_commands_set_the_variable_before_mlx_runs(flag, preset, expected):
    """What `serve`, `verify` and `bench` do first, in a fresh process: the variable MLX then reads."""
    code = ("import argparse, os\n"
            "from lockstep.server.commands.runtime_args import add_model_arguments, apply_cuda_graphs\n"
            "p = argparse.ArgumentParser(); add_model_arguments(p)\n"
            f"args = p.parse_args({['--cuda-graphs', flag] if flag else []!r})\n"
            "apply_cuda_graphs(args)\n"
            "print(os.environ.get('MLX_USE_CUDA_GRAPHS'))\n")
    env = {k: v for k, v in os.environ.items() if k != cuda_graphs.ENV}
    if preset is not None:
        env[cuda_graphs.ENV] = preset
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected
