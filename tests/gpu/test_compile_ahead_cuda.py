"""kernels/audit/compile_ahead.py on CUDA: the children compile the tiled quantized-matmul kernels
of the narrow and wide widths into MLX's kernel cache (an empty one here), and a new process
whose calls take those tiles compiles nothing: it finds every module there, whole. Negative
control: a width no child took (17 rows shares 24's tile; 1 row takes a kernel MLX ships
compiled) is covered, while a tile of another mode is not (the cache holds nvfp4 modules only)."""
import json
import subprocess
import sys

import pytest

from lockstep.kernels.audit.compile_ahead import CompileAhead
from lockstep.kernels.audit.report import LayerConfig
from lockstep.kernels.audit.widths import NARROW, WIDE

pytestmark = pytest.mark.gpu

CONFIG = LayerConfig(kind="linear", shape=(4096, 4096), mode="nvfp4", bits=4, group_size=16, dtype="bfloat16")

CALLS = """
import json, sys
import mlx.core as mx
import mlx.nn as nn
layer = nn.QuantizedLinear(4096, 4096, bias=False, group_size={group}, bits={bits}, mode="{mode}")
for rows in json.loads(sys.argv[1]):
    mx.eval(layer(mx.random.normal((1, rows, 4096)).astype(mx.bfloat16)))
"""


def modules(cache):
    return {p.relative_to(cache): p.stat().st_mtime_ns for p in cache.rglob("*.ptx")}


def calls(cache, rows, mode="nvfp4", group=16, bits=4):
    code = CALLS.format(mode=mode, group=group, bits=bits)
    subprocess.run([sys.executable, "-c", code, json.dumps(rows)], check=True, timeout=900,
                   env={**__import__("os").environ, "MLX_PTX_CACHE_DIR": str(cache)})


def test_the_children_fill_the_kernel_cache_a_new_process_then_compiles_nothing(tmp_path, monkeypatch):
    cache = tmp_path / "ptx"
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(cache))
    ahead = CompileAhead.start([CONFIG], (WIDE, NARROW))
    try:
        assert ahead.ready(WIDE, timeout=900) and ahead.ready(NARROW, timeout=900)
    finally:
        ahead.close()
    assert all(c.process.returncode == 0 and c.report and "error" not in c.report[0] for c in ahead.children)
    compiled = modules(cache)
    assert any("nvfp4" in str(p) for p in compiled), compiled  # the tiles' modules are there
    calls(cache, [8, 17, 24, 33, 96, 1])
    assert modules(cache) == compiled  # nothing compiled again, nothing rewritten

    calls(cache, [8], mode="affine", group=64)  # control: a tile of another mode is compiled
    assert set(modules(cache)) > set(compiled)
