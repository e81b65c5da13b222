"""The import graph of lockstep's three packages: no cycles, and imports only go down.

The layers, top to bottom: `server` (the engine, the HTTP service, the commands), `kernels`
(batch invariance, the audit, the custom kernels), `models` (loading and converting). A
module may import from its own package and the ones below it, never above. Imports inside
functions count too: a cycle hidden in a function body is still a cycle. Nor may the
subpackages (kernels.audit, kernels.batching, kernels.custom, kernels.invariance, server.api,
server.engine, server.distributed, ...) import each other in a cycle: a package's own modules
(kernels/verdict_cache.py is `lockstep.kernels`) count as that package. server/engine's rooms
(scheduling, decoding, runner, guarantee, cache, structured) are such packages, and none of
them imports the engine's own modules: its __init__ imports `Engine`, and with it every room.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "kernels", "models")
LAYER = {"server": 2, "kernels": 1, "models": 0}


def module_files() -> dict[str, Path]:
    """lockstep.<package>.<path> -> file, for every module of the three packages."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(["lockstep", *parts])] = path
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The lockstep modules `name` imports, anywhere in its file. `from pkg import x` is an
    edge to pkg.x when that is a module, else to pkg (its __init__ defines x)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            edges.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith("lockstep."):
                continue
            for alias in node.names:
                target = f"{source}.{alias.name}"
                edges.add(target if target in modules else source)
    edges.discard(name)
    return {e for e in edges if e in modules}


def graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def package_of(module: str, modules: dict[str, Path]) -> str:
    """The package a module belongs to: the folder its file is in."""
    return module if modules[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def package_graph(edges: dict[str, set[str]], modules: dict[str, Path]) -> dict[str, set[str]]:
    """package -> the other packages its modules import."""
    packages: dict[str, set[str]] = {}
    for a, targets in edges.items():
        own = package_of(a, modules)
        packages.setdefault(own, set()).update(p for p in (package_of(b, modules) for b in targets) if p != own)
    return packages


def layer_of(module: str) -> int:
    return LAYER[module.split(".")[1]]


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_no_import_cycles_between_packages():
    modules = module_files()
    assert cycles(package_graph(graph(), modules)) == []


def test_imports_only_go_down_the_layers():
    upward = sorted(f"{a} -> {b}" for a, targets in graph().items() for b in targets if layer_of(b) > layer_of(a))
    assert upward == []


ENGINE = "lockstep.server.engine"


def engine_rooms(modules: dict[str, Path]) -> list[str]:
    """The subpackages of server/engine."""
    return sorted({package_of(m, modules) for m in modules if m.startswith(ENGINE + ".")} - {ENGINE})


def rooms_importing_the_engine(edges: dict[str, set[str]], modules: dict[str, Path]) -> list[str]:
    """Rooms whose modules import the engine's own package (engine.py, generate.py, ...)."""
    packages = package_graph(edges, modules)
    return sorted(room for room in engine_rooms(modules) if ENGINE in packages.get(room, ()))


def test_engine_rooms_import_no_cycle_and_never_the_engine_itself():
    modules = module_files()
    rooms = engine_rooms(modules)
    assert len(rooms) >= 2  # the check has rooms to look at
    packages = package_graph(graph(), modules)
    assert cycles({room: packages.get(room, set()) & set(rooms) for room in rooms}) == []
    assert rooms_importing_the_engine(graph(), modules) == []


def test_the_checks_see_a_cycle_and_an_upward_import():
    """Control: the same checks on a graph that has both."""
    made_up = {"lockstep.models.a": {"lockstep.kernels.b"}, "lockstep.kernels.b": {"lockstep.kernels.c"},
               "lockstep.kernels.c": {"lockstep.kernels.b"}}
    assert cycles(made_up) == [["lockstep.kernels.b", "lockstep.kernels.c"]]
    assert layer_of("lockstep.kernels.b") > layer_of("lockstep.models.a")
    # a cycle of packages that no two modules close: batching.x -> invariance.y -> batching.z
    files = {"lockstep.kernels.batching.x": Path("x.py"), "lockstep.kernels.batching.z": Path("z.py"),
             "lockstep.kernels.invariance.y": Path("y.py")}
    spread = {"lockstep.kernels.batching.x": {"lockstep.kernels.invariance.y"},
              "lockstep.kernels.invariance.y": {"lockstep.kernels.batching.z"}, "lockstep.kernels.batching.z": set()}
    assert cycles(spread) == []
    assert cycles(package_graph(spread, files)) == [["lockstep.kernels.batching", "lockstep.kernels.invariance"]]
    # a room that imports the engine's own package (whose __init__ imports every room)
    files = {"lockstep.server.engine": Path("__init__.py"), "lockstep.server.engine.engine": Path("engine.py"),
             "lockstep.server.engine.scheduling.scheduler": Path("scheduler.py")}
    upward = {"lockstep.server.engine.scheduling.scheduler": {"lockstep.server.engine.engine"}}
    assert rooms_importing_the_engine(upward, files) == ["lockstep.server.engine.scheduling"]
    # and the real graph is read: the server imports the kernels somewhere
    assert any(t.startswith("lockstep.kernels") for targets in graph().values() for t in targets)
