"""Kernels launched by a short token whose module file holds the cubin
(kernels/custom/module_files.py), on the GPU: MLX finds the file where lockstep writes it, the
kernel launched that way gives the bits of the one launched from its bytes, and a token whose
file is missing does not run (the files are what make it work)."""
import mlx.core as mx
import numpy as np
import pytest

from lockstep.kernels.custom import compiled, module_files, skinny

pytestmark = pytest.mark.gpu


def test_this_machine_launches_kernels_by_name():
    assert compiled.probe_module_files(), module_files._verdict.get("why")


def _dense_rows(monkeypatch, works: bool, x, w):
    """skinny's dense rows with the token path on or off; the sources its launches passed."""
    sources = []
    real = mx.fast.precompiled_cuda_kernel

    def recording(**kw):
        sources.append(kw["compiled_source"])
        return real(**kw)

    monkeypatch.setattr(module_files, "_verdict", {"works": works})
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", recording)
    for cached in (skinny._launcher, skinny._launch_plan, skinny._traced):
        cached.cache_clear()
    try:
        y = skinny.dense_matmul(x, w)
        mx.eval(y)
    finally:
        for cached in (skinny._launcher, skinny._launch_plan, skinny._traced):
            cached.cache_clear()
        monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", real)
    return np.array(y.astype(mx.float32)), sources


def test_a_kernel_launched_by_name_is_the_kernel_launched_from_its_bytes(monkeypatch):
    assert compiled.probe_module_files()
    x = mx.random.normal((3, 4096), key=mx.random.key(1)).astype(mx.bfloat16)
    w = mx.random.normal((1024, 4096), key=mx.random.key(2)).astype(mx.bfloat16)
    by_bytes, bytes_sources = _dense_rows(monkeypatch, False, x, w)
    by_name, name_sources = _dense_rows(monkeypatch, True, x, w)
    assert bytes_sources and name_sources, "the dense rows did not take the precompiled launch"
    assert all(len(s) > 1000 for s in bytes_sources) and all(len(s) < 100 for s in name_sources)
    assert [module_files.token(s) for s in bytes_sources] == name_sources
    assert np.array_equal(by_bytes.view(np.uint32), by_name.view(np.uint32))
    # the negative control: other inputs give other bits through the same launch
    other, _ = _dense_rows(monkeypatch, True, x * 2, w)
    assert not np.array_equal(other.view(np.uint32), by_name.view(np.uint32))


def test_a_token_without_its_module_file_does_not_launch():
    assert compiled.probe_module_files()
    missing = module_files.token(b"no module file was written for this")
    with pytest.raises(RuntimeError):
        out = mx.fast.precompiled_cuda_kernel(
            name="lockstep_missing_module", compiled_source=missing, inputs=[mx.zeros((1,))],
            output_shapes=[(1,)], output_dtypes=[mx.float32], scalars=[], grid=(1, 1, 1), threadgroup=(1, 1, 1))[0]
        mx.eval(out)
    mx.eval(mx.ones((4,)) + 1)  # the device still runs work after the refused load
