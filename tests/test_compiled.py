"""Custom CUDA kernel instances compiled once per machine (kernels/custom/compiled.py) and
launched with mx.fast.precompiled_cuda_kernel.

There is no GPU (nor NVRTC) here, so the compiler is a stand-in and the launch a recorder:
these tests cover the cache (its key, its files, its concurrency), the generated wrappers
against the kernel sources, and each loader's launch against its wrapper. The NVRTC call,
the driver's load and the kernels' bits are checked on the GPU (docs/DESIGN.md)."""
import logging
import math
import re
import threading

import mlx.core as mx
import pytest

from lockstep.kernels.custom import attention, compiled, gemv_rows, nvrtc, skinny, smoke_cache, split_attention

TOOLCHAIN = compiled.Toolchain(nvrtc="13.0", mlx="0.32.4", device="NVIDIA H200", capability=(9, 0),
                               options=("--device-as-default-execution-space", "--gpu-architecture=sm_90a",
                                        "--include-path=/site/mlx/include"))


class FakeCompiler:
    """Stands in for NVRTC: a cubin naming the source's wrapper; counts its calls and the most
    that ran at once, may wait at a barrier (`gate`) or for a condition (`until`), or fail."""

    def __init__(self, fail=lambda source: False, gate: threading.Barrier | None = None, until=None):
        self.fail, self.gate, self.until, self.sources = fail, gate, until, []
        self.lock = threading.Lock()
        self.running = self.peak = 0

    def __call__(self, source, options):
        assert tuple(options) == TOOLCHAIN.options
        with self.lock:
            self.sources.append(source)
            self.running += 1
            self.peak = max(self.peak, self.running)
        try:
            if self.until is not None:
                assert self.until(), "the condition the compile waits for never came"
            if self.gate is not None:
                self.gate.wait()  # serial calls never get past it: BrokenBarrierError at its timeout
        finally:
            with self.lock:
                self.running -= 1
        if self.fail(source):
            raise nvrtc.CompileError("NVRTC: error: identifier is undefined")
        return b"CUBIN " + _symbol(source).encode()


def _symbol(source):
    return re.search(r'extern "C" __global__ void (\w+)\(', source).group(1)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A stand-in compiler and cache in place of this machine's, and the loaders' launch
    caches emptied before and after (they hold cubins or fallbacks)."""
    monkeypatch.setenv("LOCKSTEP_VERDICT_CACHE_DIR", str(tmp_path / "verdicts"))
    smoke_cache.prove_afresh(False)
    monkeypatch.setattr(compiled, "_disabled", {})

    def clear():
        for cached in (gemv_rows._launcher, gemv_rows._traced, skinny._launcher, skinny._launch_plan,
                       skinny._traced, attention._launcher, attention._traced):
            cached.cache_clear()

    def use(compiler=None, directory=None):
        cache = compiled.CubinCache(directory or tmp_path / "cubin", TOOLCHAIN, compiler or FakeCompiler())
        monkeypatch.setattr(compiled, "default_cache", lambda: cache)
        return cache

    clear()
    yield use
    clear()


# -- the cache ------------------------------------------------------------------------------

def test_the_key_follows_the_source_options_nvrtc_mlx_and_device_only():
    source = 'extern "C" __global__ void k() {}'
    key = compiled.cache_key(source, TOOLCHAIN)
    same = compiled.Toolchain(**{f: getattr(TOOLCHAIN, f) for f in TOOLCHAIN.__dataclass_fields__})
    assert compiled.cache_key(source, same) == key and re.fullmatch(r"[0-9a-f]{64}", key)
    changed = [compiled.cache_key(source + " ", TOOLCHAIN)]
    for field, value in (("options", TOOLCHAIN.options[:1] + ("--gpu-architecture=sm_80",)),
                         ("options", TOOLCHAIN.options + ("-lineinfo",)), ("nvrtc", "13.1"),
                         ("mlx", "0.32.5"), ("device", "NVIDIA H100"), ("capability", (9, 1))):
        fields = {f: getattr(TOOLCHAIN, f) for f in TOOLCHAIN.__dataclass_fields__}
        fields[field] = value
        changed.append(compiled.cache_key(source, compiled.Toolchain(**fields)))
    assert key not in changed and len(set(changed)) == len(changed)


def test_each_instance_compiles_once_and_a_restart_compiles_nothing(tmp_path):
    compiler = FakeCompiler()
    cache = compiled.CubinCache(tmp_path, TOOLCHAIN, compiler)
    sources = [f'extern "C" __global__ void k{i}() {{}}' for i in (1, 2, 1, 3, 2)]
    blobs = cache.get_many(sources, workers=4)
    assert blobs == [b"CUBIN k1", b"CUBIN k2", b"CUBIN k1", b"CUBIN k3", b"CUBIN k2"]
    assert cache.compiled == 3 and len(compiler.sources) == 3
    assert cache.get_many(sources) == blobs and cache.get(sources[3]) == b"CUBIN k3"
    assert cache.compiled == 3  # the second request: from memory
    assert len(list(tmp_path.glob("*.cubin"))) == 3

    restart = compiled.CubinCache(tmp_path, TOOLCHAIN, FakeCompiler())
    assert restart.get_many(sources) == blobs and restart.compiled == 0

    elsewhere = compiled.CubinCache(tmp_path, compiled.Toolchain(**{**TOOLCHAIN.__dict__, "device": "NVIDIA A100"}),
                                    FakeCompiler())
    assert elsewhere.get(sources[0]) == b"CUBIN k1" and elsewhere.compiled == 1


@pytest.mark.parametrize("damage", [
    lambda data: data[: len(data) // 2],  # cut short
    lambda data: data[:-1] + b"X",  # a flipped byte: the digest no longer checks out
    lambda data: b"garbage",
])
def test_a_corrupt_file_is_compiled_again_with_a_warning(tmp_path, caplog, damage):
    source = 'extern "C" __global__ void k() {}'
    first = compiled.CubinCache(tmp_path, TOOLCHAIN, FakeCompiler())
    first.get(source)
    path = first.path(first.key(source))
    path.write_bytes(damage(path.read_bytes()))
    again = compiled.CubinCache(tmp_path, TOOLCHAIN, FakeCompiler())
    with caplog.at_level(logging.WARNING, logger=compiled.__name__):
        assert again.get(source) == b"CUBIN k"
    assert again.compiled == 1 and "corrupt cached kernel" in caplog.text
    assert compiled.CubinCache(tmp_path, TOOLCHAIN, FakeCompiler()).get(source) == b"CUBIN k"  # rewritten


def test_a_failed_compile_is_reported_in_place_and_not_kept(tmp_path):
    compiler = FakeCompiler(fail=lambda s: "bad" in s)
    cache = compiled.CubinCache(tmp_path, TOOLCHAIN, compiler)
    sources = ['extern "C" __global__ void good() {}', 'extern "C" __global__ void bad() {}']
    good, bad = cache.get_many(sources, return_exceptions=True)
    assert good == b"CUBIN good" and isinstance(bad, nvrtc.CompileError)
    with pytest.raises(nvrtc.CompileError):
        cache.get(sources[1])  # tried again, not remembered
    assert len(compiler.sources) == 3 and len(list(tmp_path.glob("*.cubin"))) == 1


def test_instances_compile_concurrently(tmp_path):
    count, workers = 8, 4
    # each compile waits until `workers` of them run at once (a hang guard, not a timing)
    compiler = FakeCompiler(gate=threading.Barrier(workers, timeout=60))
    cache = compiled.CubinCache(tmp_path, TOOLCHAIN, compiler)
    cache.get_many([f'extern "C" __global__ void k{i}() {{}}' for i in range(count)], workers=workers)
    assert cache.compiled == count
    assert compiler.peak == workers  # never more than the workers, and that many at once


class CountingLock:
    """A lock that counts how often it was taken: CubinCache takes its lock once as a request
    arrives (to claim the source or find it pending), so the count says who has asked."""

    def __init__(self):
        self._lock, self._taken = threading.Lock(), threading.Condition()
        self.count = 0

    def __enter__(self):
        self._lock.acquire()
        with self._taken:
            self.count += 1
            self._taken.notify_all()

    def __exit__(self, *exc):
        self._lock.release()

    def reached(self, count, timeout=60):
        with self._taken:
            return self._taken.wait_for(lambda: self.count >= count, timeout)


def test_two_threads_asking_for_one_instance_compile_it_once(tmp_path):
    asked = CountingLock()
    # the compile ends only after all three threads asked, so two of them find it pending
    compiler = FakeCompiler(until=lambda: asked.reached(3))
    cache = compiled.CubinCache(tmp_path, TOOLCHAIN, compiler)
    cache._lock = asked
    source, got = 'extern "C" __global__ void k() {}', []
    threads = [threading.Thread(target=lambda: got.append(cache.get(source))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [b"CUBIN k"] * 3 and len(compiler.sources) == 1


def test_the_architecture_flag_is_mlxs():
    assert nvrtc.arch_option((13, 0), (9, 0)) == "--gpu-architecture=sm_90a"
    assert nvrtc.arch_option((12, 4), (8, 9)) == "--gpu-architecture=sm_89"
    assert nvrtc.arch_option((11, 4), (9, 0)) == "--gpu-architecture=compute_90a"  # no SASS: PTX
    assert nvrtc.arch_option((11, 4), (8, 6)) == "--gpu-architecture=sm_86"


# -- the wrappers against the sources and the launches --------------------------------------

def _families():
    """(family, template) of each CUDA kernel family, one instance each."""
    out = [gemv_rows.instances(5, 70, 192, mx.float16)[0], attention.instances(mx.bfloat16, 128)[0],
           split_attention.instances(mx.float32, 64)[0]]
    for kind, group in (("dense", 0), ("affine", 64), ("nvfp4", 0)):
        out += skinny.instances(kind, 3, 48, 128, mx.bfloat16, group)  # tensor cores
        out += skinny.instances(kind, 3, 48, 128, mx.float32, group)  # the scalar kernel
    return out


def _signature(wrapper):
    head = re.match(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(([^)]*)\) \{', wrapper)
    params = [re.fullmatch(r"(.+?)\s*(\w+)", p.strip()).groups() for p in head.group(2).split(",")]
    return head.group(1), params


def _device_function(header, call):
    """Parameter names of the __device__ function the wrapper's body calls, from the source."""
    name = re.match(r"\w+::(\w+)<", call).group(1)
    found = re.search(rf"__device__ void {name}\(([^)]*)\)", header)
    assert found, f"{name} not in the source"
    return [re.search(r"(\w+)$", p.strip()).group(1) for p in found.group(1).split(",")]


@pytest.mark.parametrize("index", range(9))
def test_each_wrapper_is_inputs_outputs_then_the_int_scalars_the_body_passes_on(index):
    family, template = _families()[index]
    symbol, params = _signature(family.wrapper(template))
    assert symbol == family.symbol(template) and symbol.startswith(family.name + "_")
    names = [n for _, n in params]
    assert names == [n for n, _ in family.inputs] + [n for n, _ in family.outputs] + list(family.scalar_names)
    types = [t for t, _ in params]
    assert all(t.startswith("const ") and t.endswith("*") for t in types[:len(family.inputs)])
    assert all(t.endswith("*") and not t.startswith("const") for t in types[len(family.inputs):-len(family.scalars)])
    assert types[-len(family.scalars):] == ["int"] * len(family.scalars)
    # the body: template values as constants, the shapes replaced by the scalars, in the
    # positions of the device function's trailing parameters of those names
    assert "_shape" not in family.call and family.call in family.wrapper(template)
    args = [a.strip() for a in re.search(r"\((.*)\);", family.call).group(1).split(",")]
    callee = _device_function(family.header, family.call)
    assert len(args) == len(callee)
    assert args[-len(family.scalars):] == callee[-len(family.scalars):] == list(family.scalar_names)
    # and the old body passed the shapes the scalars stand for in exactly those places
    old = [a.strip() for a in re.search(r"\((.*)\);", family.body).group(1).split(",")]
    assert old[-len(family.scalars):] == [expr for _, expr in family.scalars]
    for name, value in template:
        assert re.search(rf"(constexpr (int|bool) {name} = |using {name} = )", family.wrapper(template))


def test_a_family_of_blocks_above_256_threads_bounds_its_wrapper_by_the_block_it_launches(recorded):
    """Unbounded, NVRTC 13.5 gave split_attention's float32 instances 130 registers a thread,
    more than its 512-thread block may hold: their launch failed on an H100 (85-88 bounded)."""
    bounded = {}
    for family, template in _families():
        head = family.wrapper(template).splitlines()[0]
        bounded[family.name] = re.search(r"__launch_bounds__\((\d+)\)", head)
    assert int(bounded.pop("lockstep_split_attention").group(1)) == split_attention.THREADS == 512
    assert not any(bounded.values())  # blocks of 256 threads or fewer: no bound needed
    _, calls = recorded
    q = mx.ones((1, 4, 3, 64), dtype=mx.float32)
    k = v = mx.ones((2, 300, 64), dtype=mx.float32)
    split_attention.kernel_attention(q, k, v, attention.PoolRows([0, 5, 40], [1, 31, 33]), 0.125)
    assert calls[0]["threadgroup"] == (split_attention.family().threads, 1, 1)


def test_instances_have_distinct_symbols_and_one_kernel_per_source():
    instances = [(f, t) for f, t in _families()]
    instances += skinny.instances("dense", 17, 48, 128, mx.bfloat16) + skinny.instances("dense", 4, 48, 100, mx.float32)
    symbols = [f.symbol(t) for f, t in instances]
    assert len(set(symbols)) == len(symbols)
    for family, template in instances:
        source = family.source(template)
        assert source.startswith(compiled.PRELUDE) and source.count("__global__") == 1


# the launches: the recorder stands in for mx.fast.precompiled_cuda_kernel
C_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.uint32: "uint32_t",
           mx.uint8: "uint8_t", mx.int32: "int"}


@pytest.fixture
def recorded(fresh, monkeypatch):
    cache = fresh()
    calls = []

    def precompiled_cuda_kernel(**kw):
        calls.append(kw)
        return [mx.zeros(shape, dtype=dtype) for shape, dtype in zip(kw["output_shapes"], kw["output_dtypes"])]

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", precompiled_cuda_kernel)
    for module in (skinny, attention):
        monkeypatch.setattr(module, "backend", lambda: "cuda")
    return cache, calls


def _check_launch(call, family, template, cache, planned=None):
    """What the loader passed matches the wrapper: the cubin of that instance, one array per
    pointer of the right type, and scalars equal to the shapes cuda_kernel passed (planned:
    inputs the precompiled launch takes in another shape of the same size, by name)."""
    assert call["name"] == family.symbol(template)
    assert call["compiled_source"] == cache.get(family.source(template))
    params = family.parameters(template)
    inputs = call["inputs"]
    assert [f"const {C_TYPES[a.dtype]}*" for a in inputs] == [t for t, _ in params[:len(inputs)]]
    outputs = [f"{C_TYPES[d]}*" for d in call["output_dtypes"]]
    assert outputs == [t for t, _ in params[len(inputs):len(inputs) + len(outputs)]]
    names = [n for n, _ in family.inputs]
    planned = planned or {}
    for n, a in zip(names, inputs):
        assert a.size == math.prod(planned.get(n, a.shape))
    shapes = {f"{n}_shape[{i}]": shape[i] for n, a in zip(names, inputs)
              for shape in [planned.get(n, a.shape)] for i in range(len(shape))}
    assert call["scalars"] == [shapes[expr] for _, expr in family.scalars]
    assert all(type(v) is int for v in call["scalars"]) and call["ensure_row_contiguous"] is True


def test_gemv_rows_launches_its_wrapper(recorded):
    cache, calls = recorded
    x, w = mx.ones((5, 192), dtype=mx.float16), mx.ones((70, 192), dtype=mx.float16)
    assert gemv_rows.matmul(x, w).shape == (5, 70)
    family, template = gemv_rows.instances(5, 70, 192, mx.float16)[0]
    _check_launch(calls[0], family, template, cache)
    plan = gemv_rows._launch_plan(5, 70, 192, mx.float16, None)
    assert (calls[0]["grid"], calls[0]["threadgroup"]) == (plan["grid"], plan["threadgroup"])


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_the_skinny_kernels_launch_their_wrappers(recorded, dtype):
    cache, calls = recorded
    x = mx.ones((3, 128), dtype=dtype)
    skinny.dense_matmul(x, mx.ones((48, 128), dtype=dtype))
    w = mx.ones((48, 128), dtype=dtype)
    for mode, group in (("affine", 64), ("nvfp4", 16)):
        wq, scales, *biases = mx.quantize(w, group, 4, mode=mode)
        skinny.quantized_matmul(x, wq, scales, biases[0] if biases else None, group_size=group, bits=4, mode=mode)
    expected = [skinny.instances(kind, 3, 48, 128, dtype, group)[0]
                for kind, group in (("dense", 0), ("affine", 64), ("nvfp4", 0))]
    assert len(calls) == 3
    for call, (family, template) in zip(calls, expected):
        _check_launch(call, family, template, cache)


def test_pooled_attention_launches_its_wrapper(recorded):
    cache, calls = recorded
    q = mx.ones((1, 6, 3, 64), dtype=mx.float16)
    k = v = mx.ones((2, 300, 64), dtype=mx.float16)
    assert attention.kernel_attention(q, k, v, attention.PoolRows([0, 5, 40], [1, 31, 33]), 0.125).shape == (1, 6, 3, 64)
    family, template = attention.instances(mx.float16, 64)[0]
    _check_launch(calls[0], family, template, cache, planned={"q": (6, 3, 64)})
    assert calls[0]["grid"] == (6 * 3 * attention.THREADS, 1, 1)
    # the queries go in and the output comes out in the layer's shape: no view nodes around it
    assert calls[0]["inputs"][0].shape == (1, 6, 3, 64) and calls[0]["output_shapes"] == [(1, 6, 3, 64)]


def test_a_launch_shape_is_planned_and_its_arguments_converted_once(recorded):
    """Later launches of a shape replay the traced call: the kernel's arguments (its cubin
    among them) reach MLX once per shape, not once per launch."""
    cache, calls = recorded
    x, w = mx.ones((4, 64), dtype=mx.float32), mx.ones((9, 64), dtype=mx.float32)
    outs = [gemv_rows.matmul(x * i, w) for i in range(3)]
    assert gemv_rows._launcher.cache_info().misses == 1 and cache.compiled == 1
    assert len(calls) == 1 and all(o.shape == (4, 9) for o in outs)
    gemv_rows.matmul(mx.ones((5, 64), dtype=mx.float32), w)  # another shape: traced anew
    assert len(calls) == 2 and calls[1]["inputs"][0].shape == (5, 64)


def test_a_traced_launch_computes_what_the_call_does_from_the_inputs_it_is_given():
    seen = []

    def call(inputs, scale):
        seen.append(len(inputs))
        return [inputs[0] @ inputs[1].T * scale]

    run = compiled.traced(call, {"scale": 2.0})
    for seed in range(3):
        x, w = mx.random.normal((3, 8), key=mx.random.key(seed)), mx.random.normal((5, 8), key=mx.random.key(9))
        assert mx.array_equal(run(x, w)[0], x @ w.T * 2.0).item()
    assert seen == [2]  # traced once, replayed for the later inputs


# -- the fallback ---------------------------------------------------------------------------

def test_without_the_precompiled_path_the_loaders_keep_cuda_kernel(fresh, monkeypatch):
    monkeypatch.setattr(compiled, "default_cache", lambda: None)  # no NVRTC, or switched off
    monkeypatch.setattr(gemv_rows, "_kernel", lambda: "cuda_kernel")
    call, launch = gemv_rows._launcher(3, 33, 256, mx.float16, None)
    assert call == "cuda_kernel" and launch is gemv_rows._launch_plan(3, 33, 256, mx.float16, None)
    monkeypatch.setattr(skinny, "_kernel", lambda which, kind: (which, kind))
    call, launch = skinny._launcher("cuda", "dense", 3, 48, 128, 0, mx.bfloat16)
    assert call == ("cuda_mma", "dense") and [n for n, _ in launch["template"]] == ["T", "R8", "NT"]
    assert compiled.precompile(gemv_rows.instances(3, 33, 256, mx.float16)) == 0


def test_a_failed_compile_switches_its_loader_back_with_one_warning(fresh, monkeypatch, caplog):
    fresh(FakeCompiler(fail=lambda s: "lockstep_gemv_rows" in s))
    monkeypatch.setattr(gemv_rows, "_kernel", lambda: "cuda_kernel")
    with caplog.at_level(logging.WARNING, logger=compiled.__name__):
        assert gemv_rows._launcher(3, 33, 256, mx.float16, None)[0] == "cuda_kernel"
        assert gemv_rows._launcher(5, 70, 192, mx.float32, None)[0] == "cuda_kernel"
    assert caplog.text.count("switched off") == 1 and "identifier is undefined" in caplog.text
    assert not compiled.enabled("gemv_rows") and compiled.enabled("skinny")
    call, _ = skinny._launcher("cuda", "dense", 3, 48, 128, 0, mx.bfloat16)
    assert call is mx.fast.precompiled_cuda_kernel  # the other loaders stay precompiled


def test_switching_a_loader_off_forgets_its_precompiled_launches(fresh, monkeypatch):
    fresh()
    monkeypatch.setattr(skinny, "_kernel", lambda which, kind: "cuda_kernel")
    assert skinny._launcher("cuda", "dense", 3, 48, 128, 0, mx.bfloat16)[0] is mx.fast.precompiled_cuda_kernel
    compiled.disable("skinny", "failed its smoke test")
    assert skinny._launcher("cuda", "dense", 3, 48, 128, 0, mx.bfloat16)[0] == "cuda_kernel"


def test_a_smoke_failure_on_the_precompiled_path_retries_on_cuda_kernel(fresh):
    fresh()
    seen = []

    def run():  # wrong on the precompiled path only
        seen.append(compiled.mode("gemv_rows"))
        return "rows differ" if seen[-1] == "precompiled" else None

    assert compiled.smoke("k", "gemv_rows", run, compiled.SOURCE) is None
    assert seen == ["precompiled", "cuda_kernel"] and not compiled.enabled("gemv_rows")
    # the pass was kept for the cuda_kernel path only: a later start tries precompiled
    # again, and falls back on the kept cuda_kernel pass
    compiled._disabled.clear()
    assert compiled.smoke("k", "gemv_rows", run, compiled.SOURCE) is None
    assert seen[2:] == ["precompiled"] and not compiled.enabled("gemv_rows")


def test_a_smoke_pass_is_kept_per_path(fresh):
    fresh()
    seen = []

    def run():
        seen.append(compiled.mode("skinny"))
        return None

    for _ in range(2):
        assert compiled.smoke("k", "skinny", run, compiled.SOURCE) is None
    assert seen == ["precompiled"]


# -- tracing and shaping launches ---------------------------------------------------------

def test_launches_are_traced_on_cuda_only():
    """A Metal launch (never run here) keeps its direct call: one call of the kernel a launch."""
    seen = []

    def call(inputs, scale):
        seen.append(scale)
        return [inputs[0] * scale]

    x = mx.ones((2, 3))
    direct = compiled.traced_on("metal", call, {"scale": 3.0})
    for _ in range(2):
        assert mx.array_equal(direct(x)[0], x * 3.0).item()
    assert seen == [3.0, 3.0]
    cuda = compiled.traced_on("cuda", call, {"scale": 2.0})
    for _ in range(2):
        assert mx.array_equal(cuda(x)[0], x * 2.0).item()
    assert seen == [3.0, 3.0, 2.0]


@pytest.mark.parametrize("precompiled", [True, False])
def test_a_shaped_launch_reshapes_only_for_cuda_kernel(monkeypatch, precompiled):
    seen = []

    def call(inputs, output_shapes, output_dtypes, **_):
        seen.append(([a.shape for a in inputs], list(output_shapes)))
        x = inputs[0].reshape(-1, inputs[0].shape[-1])
        return [mx.full(shape, x.sum(), dtype) for shape, dtype in zip(output_shapes, output_dtypes)]

    monkeypatch.setattr(compiled, "sizes_are_scalars", lambda c: precompiled and c is call)
    plan = dict(output_shapes=[(3, 5), (3, 2)], output_dtypes=[mx.float32, mx.float32])
    launch = compiled.shaped_launch(call, plan, (3, 4), [(1, 3, 5), (1, 3, 2)])
    x = mx.ones((1, 3, 4))
    ys = launch(x, mx.zeros((2,)))
    assert [y.shape for y in ys] == [(1, 3, 5), (1, 3, 2)] and all(mx.all(y == 12).item() for y in ys)
    # the precompiled launch takes x as it is and writes the layer's shapes: no reshape nodes
    assert seen[-1] == (([(1, 3, 4), (2,)], [(1, 3, 5), (1, 3, 2)]) if precompiled
                        else ([(3, 4), (2,)], [(3, 5), (3, 2)]))
    assert plan["output_shapes"] == [(3, 5), (3, 2)]  # the cached plan is left as it was
