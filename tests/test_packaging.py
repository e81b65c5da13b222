"""What `pip install .` puts into site-packages: one top-level name, `lockstep`.

The product's folders server/, kernels/ and models/ install as lockstep.server,
lockstep.kernels and lockstep.models (pyproject.toml's package-dir mapping), so nothing of
ours can shadow another distribution's import name (Hugging Face's `kernels`, say).
"""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md"):  # a copy, so the build leaves nothing in the tree
        shutil.copy(ROOT / name, source / name)
    for folder in ("server", "kernels", "models"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(source)],
                   check=True, capture_output=True, text=True, timeout=600)
    (built,) = out.glob("lockstep-*.whl")
    return built


def test_the_only_top_level_name_is_lockstep(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        assert z.read(top_level).decode().split() == ["lockstep"]
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"lockstep"}
    # the three packages are all there, with the kernels' sources beside their loaders
    for path in ("lockstep/server/cli.py", "lockstep/kernels/custom/gemv_rows.cu",
                 "lockstep/kernels/cpu_blas/shim.c", "lockstep/models/load.py"):
        assert path in names
    # every package folder of the tree is in the wheel (a new subpackage must be listed)
    folders = {p.parent.relative_to(ROOT).as_posix() for d in ("server", "kernels", "models")
               for p in (ROOT / d).rglob("__init__.py")}
    assert {f"lockstep/{f}/__init__.py" for f in folders} <= set(names)
    assert not any(n.startswith("tests/") for n in names)  # test doubles stay out of the wheel


def test_installed_alone_kernels_is_not_an_import_name(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    probe = ("import importlib.util, sys; "
             "print(importlib.util.find_spec('kernels') is None, importlib.util.find_spec('server') is None, "
             "importlib.util.find_spec('lockstep.kernels.custom').origin)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, check=True, capture_output=True, text=True,
                         env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}).stdout.split()
    assert out[:2] == ["True", "True"]
    assert out[2].startswith(str(target))


def _closure(requirements, extra: str = "") -> set[str]:
    """The installed distributions `requirements` pull in (their markers read for `extra`)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen, stack = set(), [(r, extra) for r in requirements]
    while stack:
        text, wanted = stack.pop()
        req = Requirement(text)
        if req.marker and not req.marker.evaluate({"extra": wanted}):
            continue
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            needs = md.distribution(name).requires or []
        except md.PackageNotFoundError:
            continue
        stack += [(r, e) for e in ("", *req.extras) for r in needs]
    return seen


def test_the_product_imports_nothing_only_the_test_extras_install():
    """`make serve` installs `pip install -e .`, without the test extras: a module of server/,
    kernels/ or models/ importing a distribution that only the extras bring (openai, httpx,
    jsonschema, ...) would fail there, and not in the suite."""
    import ast
    import importlib.metadata as md

    from packaging.utils import canonicalize_name

    requires = md.distribution("lockstep").requires
    test_only = _closure(requires, "test") - _closure(requires)
    assert {"openai", "pytest", "jsonschema"} <= test_only  # the closure is read, not empty
    owners = md.packages_distributions()
    found = {}
    for folder in ("server", "kernels", "models"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                         else [])
                for name in names:
                    top = name.split(".")[0]
                    dists = {canonicalize_name(d) for d in owners.get(top, [])}
                    if dists and dists <= test_only:
                        found.setdefault(top, []).append(str(path.relative_to(ROOT)))
    assert found == {}, f"imports only the test extras install: {found}"
