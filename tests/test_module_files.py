"""A precompiled kernel launched by a short token whose module file holds its cubin
(kernels/custom/module_files.py). No GPU here: these tests cover the name MLX would give the
module (libstdc++'s string hash against a port of it), the files written (where MLX looks:
tests/test_mlx_jit_dir.py), and when a launch passes the token rather than the cubin. That MLX loads the file
and the kernel's bits are the same is tests/gpu/test_module_files_cuda.py."""
import mlx.core as mx
import pytest

from lockstep.kernels.custom import compiled, module_files, skinny

MUL = 0xC6A4A7935BD1E995
MASK = (1 << 64) - 1


def _shift_mix(v):
    return v ^ (v >> 47)


def hash_bytes_port(data: bytes, seed: int = 0xC70F6907) -> int:
    """libstdc++'s std::_Hash_bytes for a 64-bit size_t (libsupc++/hash_bytes.cc), in Python."""
    n = len(data)
    aligned = n & ~7
    h = (seed ^ (n * MUL)) & MASK
    for i in range(0, aligned, 8):
        word = int.from_bytes(data[i:i + 8], "little")
        h = ((h ^ ((_shift_mix((word * MUL) & MASK) * MUL) & MASK)) * MUL) & MASK
    if n & 7:
        h = ((h ^ int.from_bytes(data[aligned:], "little")) * MUL) & MASK
    return _shift_mix((_shift_mix(h) * MUL) & MASK)


@pytest.mark.parametrize("data", [b"", b"a", b"hello", b"0123456", b"01234567", b"012345678",
                                  bytes(range(17)), module_files.token(b"\x7fELF cubin")])
def test_the_module_name_hash_is_libstdcxx_string_hash(data):
    assert module_files.string_hash(data) == hash_bytes_port(data)


def test_the_hash_is_std_hash_of_a_string():
    # printf("%zx", std::hash<std::string>{}("hello")) from a g++ (libstdc++) build
    assert module_files.string_hash(b"hello") == 0x26553298FDBE39C8


def test_the_module_is_named_as_mlxs_custom_kernel_names_it():
    short = module_files.token(b"cubin bytes")
    assert module_files.module_name("k_f16_8", short) == f"k_f16_8_{hash_bytes_port(short):x}"


def test_a_token_names_its_cubin_in_a_few_bytes():
    a, b = module_files.token(b"x" * 60_000), module_files.token(b"y" * 60_000)
    assert a != b and len(a) < 100 and a == module_files.token(b"x" * 60_000)


@pytest.fixture
def clean(monkeypatch, tmp_path):
    monkeypatch.setattr(module_files, "_verdict", {})
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    return tmp_path / "ptx"


def test_the_module_files_are_the_kernel_list_and_the_image(clean):
    short = module_files.write_module("kern_a", b"\x7fELF the cubin")
    module = module_files.module_name("kern_a", short)
    assert short == module_files.token(b"\x7fELF the cubin")
    assert (clean / f"{module}.ptx").read_bytes() == b"\x7fELF the cubin"
    assert (clean / f"{module}.txt").read_bytes() == b"kern_a\tkern_a\n"
    assert sorted(p.name for p in clean.iterdir()) == [f"{module}.ptx", f"{module}.txt"]  # no partial left


def test_a_file_found_with_other_bytes_is_written_again(clean):
    short = module_files.write_module("kern_b", b"right")
    image = clean / f"{module_files.module_name('kern_b', short)}.ptx"
    image.write_bytes(b"wrong")
    assert module_files.write_module("kern_b", b"right") == short and image.read_bytes() == b"right"
    image.unlink()  # e.g. a temporary-files cleaner, before a later launch shape's plan
    assert module_files.write_module("kern_b", b"right") == short and image.read_bytes() == b"right"


def test_where_the_files_cannot_be_written_the_cubin_is_launched_with_one_warning(clean, monkeypatch, caplog):
    clean.parent.joinpath("ptx").write_bytes(b"a file where the directory should be")
    monkeypatch.setattr(module_files, "_verdict", {"works": True})
    assert module_files.write_module("kern_c", b"cubin") is None
    assert module_files.source_for("kern_c", b"cubin") == b"cubin"
    assert module_files.source_for("kern_c2", b"other cubin") == b"other cubin"
    assert [r.levelname for r in caplog.records] == ["WARNING"]


def test_a_name_mlx_would_nest_in_directories_is_launched_from_its_cubin(clean):
    assert module_files.write_module("k" * 240, b"cubin") is None


def test_the_token_is_launched_only_after_the_probe_passed(clean, monkeypatch):
    assert module_files.source_for("kern_d", b"cubin") == b"cubin"  # not probed
    monkeypatch.setattr(module_files, "_verdict", {"works": False})
    assert module_files.source_for("kern_d", b"cubin") == b"cubin"
    monkeypatch.setattr(module_files, "_verdict", {"works": True})
    assert module_files.source_for("kern_d", b"cubin") == module_files.token(b"cubin")


def test_the_probe_runs_its_kernel_once_a_process(clean, monkeypatch, caplog):
    caplog.set_level("INFO", logger=module_files.log.name)
    launches = []

    def precompiled_cuda_kernel(**kw):
        launches.append(kw)
        module = module_files.module_name(kw["name"], kw["compiled_source"])
        assert (clean / f"{module}.ptx").read_bytes() == b"probe cubin"  # in place before the launch
        return [kw["inputs"][0] + 1]

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", precompiled_cuda_kernel)
    sources = []
    assert module_files.probe(lambda source: sources.append(source) or b"probe cubin") is True
    assert module_files.probe(lambda source: b"never asked") is True
    assert len(launches) == 1 and sources == [module_files.PROBE_SOURCE]
    assert str(clean) in caplog.text  # the log says where the modules are
    assert launches[0]["compiled_source"] == module_files.token(b"probe cubin")


@pytest.mark.parametrize("failure", ["raises", "wrong value", "switched off"])
def test_a_failed_probe_keeps_every_launch_on_its_cubin(clean, monkeypatch, caplog, failure):
    def precompiled_cuda_kernel(**kw):
        if failure == "raises":  # MLX found no file: it loaded the token as an image
            raise RuntimeError("Failed to load compiled kernel: device kernel image is invalid")
        # switched off, even a launch that would work is never tried
        return [kw["inputs"][0] + (1 if failure == "switched off" else 0)]

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", precompiled_cuda_kernel)
    if failure == "switched off":
        monkeypatch.setenv(module_files.OFF_ENV, "0")
    assert module_files.probe(lambda source: b"probe cubin") is False
    assert module_files.source_for("kern_e", b"cubin") == b"cubin"
    if failure != "switched off":
        assert [r.levelname for r in caplog.records] == ["WARNING"]


def test_a_loaders_launch_passes_the_token_once_probed(clean, monkeypatch, tmp_path):
    """skinny's launch through compiled.launcher: the token in place of the cubin, and the
    module file holds the cubin the cache gave."""
    monkeypatch.setattr(compiled, "_disabled", {})
    cache = compiled.CubinCache(tmp_path / "cubin", compiled.Toolchain(
        nvrtc="13.0", mlx="0.32.4", device="NVIDIA H200", capability=(9, 0), options=()),
        lambda source, options: b"\x7fELF " + source.encode()[-40:])
    monkeypatch.setattr(compiled, "default_cache", lambda: cache)
    monkeypatch.setattr(module_files, "_verdict", {"works": True})
    skinny._launcher.cache_clear()
    try:
        call, launch = skinny._launcher("cuda", "dense", 3, 48, 128, 0, mx.bfloat16)
    finally:
        skinny._launcher.cache_clear()
    family, template = skinny.instances("dense", 3, 48, 128, mx.bfloat16, 0)[0]
    blob = cache.get(family.source(template))
    assert call is mx.fast.precompiled_cuda_kernel and launch["compiled_source"] == module_files.token(blob)
    module = module_files.module_name(launch["name"], launch["compiled_source"])
    assert (clean / f"{module}.ptx").read_bytes() == blob
