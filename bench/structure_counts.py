"""Structure counts of one lockstep checkout (issue 52: before/after), stdlib only.

    python3 bench/structure_counts.py PATH [--python PYTHON] [--no-tests]

Prints, for the checkout at PATH:
- where L is stored: the class fields (annotated at class level, or set as `self.x`) that hold
  the batch-invariant limit, and under how many names; and the function parameters in
  kernels/ and server/ named as L has been named;
- files and import floors per package (folder): a module's floor is 0 when it imports no
  lockstep module, else one above the highest floor it imports (modules in a cycle share one);
  a package's floor is the same over the package graph, where a folder's files are one node
  (so a package that imports scheduling/errors.py sits above everything scheduler.py imports);
- module and package import cycles (the graph of tests/test_import_graph.py of *this* script's
  checkout, read from PATH's files, so both trees are judged by one rule);
- docs lines by file, guides apart from history;
- comment and docstring lines of server/, kernels/ and models/ that name a "session";
- bench scripts and result files;
- the test count: `pytest --collect-only -q` in PATH, its packages imported from PATH
  (a namespace of links on PYTHONPATH, as on the lent GPU) with PYTHON (default: this one).
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import io
import os
import re
import subprocess
import sys
import tempfile
import tokenize
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "kernels", "models")

# The names L has been held under in this repository. `call_rows`, `batch_invariant_limit`
# and `guaranteed_rows` mean L wherever they appear; `limit` and `rows` also name other things
# (a body's byte limit, a pass's rows), so those count only as int fields of the classes
# that carry L (NOT_L lists the others, each with what it holds instead).
L_NAMES = ("call_rows", "batch_invariant_limit", "guaranteed_rows", "limit", "rows")
AMBIGUOUS = ("limit", "rows")
NOT_L = {
    "BodySizeLimit.limit": "request body bytes",
    "Refusal.limit": "the grammar limit a schema met",
    "Demand.rows": "a request's rows in a pass",
    "PathResult.rows": "rows an audit probe ran",
    "_PassSlots.rows": "a compiled pass's row count",
    "PooledPass.rows": "a pass's rows per request",
    "RaggedLayerCache.rows": "a request's rows in a ragged pass",
    "PassOutput.rows": "a pass's rows per request",
}
L_PARAMETERS = ("limit", "call_rows", "L", "batch_invariant_limit")


def import_graph_code():
    """tests/test_import_graph.py of this script's checkout (its edge and cycle rules)."""
    spec = importlib.util.spec_from_file_location("import_graph", HERE / "tests" / "test_import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def module_files(root: Path) -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(["lockstep", *parts])] = path
    return found


def python_files(root: Path):
    for package in PACKAGES:
        yield from sorted((root / package).rglob("*.py"))


# --- L ---------------------------------------------------------------------------------

def class_fields(cls: ast.ClassDef):
    """(name, annotation source or None) of a class's fields."""
    for statement in cls.body:
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            yield statement.target.id, ast.unparse(statement.annotation)
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                yield target.attr, ast.unparse(node.annotation) if isinstance(node, ast.AnnAssign) else None


def l_fields(root: Path):
    held, other = [], []
    for path in python_files(root):
        tree = ast.parse(path.read_text())
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            seen = set()
            for name, annotation in class_fields(cls):
                if name not in L_NAMES or name in seen:
                    continue
                seen.add(name)
                where = f"{path.relative_to(root)} {cls.name}.{name}"
                if f"{cls.name}.{name}" in NOT_L:
                    other.append(f"{where} ({NOT_L[cls.name + '.' + name]})")
                elif name in AMBIGUOUS and annotation != "int":
                    other.append(f"{where} (not an int field: {annotation})")
                else:
                    held.append((where, name))
    return held, other


def l_parameters(root: Path) -> dict[str, Counter]:
    """Function parameters named as L has been named, in kernels/ and in server/ outside
    server/api/ (whose `limit`s are request limits: bytes, tokens, queue places)."""
    counts = {"kernels": Counter(), "server": Counter()}
    for path in python_files(root):
        parts = path.relative_to(root).parts
        if parts[0] not in counts or parts[:2] == ("server", "api"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                counts[parts[0]].update(a.arg for a in arguments if a.arg in L_PARAMETERS)
    return counts


# --- imports ---------------------------------------------------------------------------

def floors(edges: dict[str, set[str]], cycles) -> dict[str, int]:
    """Each node's floor; the members of a cycle are one node."""
    component = {v: v for v in edges}
    for members in cycles(edges):
        for v in members:
            component[v] = members[0]
    merged = defaultdict(set)
    for v, targets in edges.items():
        merged[component[v]].update(component[t] for t in targets if component[t] != component[v])
    floor: dict[str, int] = {}

    def of(v):
        if v not in floor:
            floor[v] = 1 + max((of(t) for t in merged[v]), default=-1)
        return floor[v]

    sys.setrecursionlimit(10000)
    return {v: of(component[v]) for v in edges}


def import_section(root: Path, code) -> list[str]:
    modules = module_files(root)
    edges = {name: code.imports_of(name, path, modules) for name, path in modules.items()}
    packages = code.package_graph(edges, modules)
    for name in modules:
        packages.setdefault(code.package_of(name, modules), set())
    module_cycles = code.cycles(edges)
    package_cycles = code.cycles(packages)
    module_floor = floors(edges, code.cycles)
    package_floor = floors(packages, code.cycles)
    files = Counter(code.package_of(name, modules) for name, path in modules.items())
    module_floors = defaultdict(list)
    for name in modules:
        module_floors[code.package_of(name, modules)].append(module_floor[name])
    out = ["| package | .py files | package floor | module floors |", "|---|---|---|---|"]
    for package in sorted(files):
        low, high = min(module_floors[package]), max(module_floors[package])
        out.append(f"| {package.removeprefix('lockstep.')} | {files[package]} | {package_floor[package]} | "
                   f"{low}..{high} |")
    out.append(f"| all | {len(modules)} | {max(package_floor.values())} | 0..{max(module_floor.values())} |")
    out.append("")
    out.append(f"module import cycles: {len(module_cycles)}"
               + "".join(f"\n  {' <-> '.join(m.removeprefix('lockstep.') for m in c)}" for c in module_cycles))
    out.append(f"package import cycles: {len(package_cycles)}"
               + "".join(f"\n  {' <-> '.join(m.removeprefix('lockstep.') for m in c)}" for c in package_cycles))
    out.append(f"import edges between modules: {sum(len(t) for t in edges.values())}")
    return out


# --- docs, comments, bench, tests --------------------------------------------------------

def docs_section(root: Path) -> list[str]:
    names = sorted({*root.glob("docs/**/*.md"), root / "README.md", root / "bench" / "README.md",
                    root / "tests" / "gpu" / "README.md", *root.glob("bench/results/history/**/*.md")})
    totals = Counter()
    out = ["| file | kind | lines |", "|---|---|---|"]
    for path in names:
        if not path.is_file():
            continue
        kind = "history" if "history" in path.relative_to(root).parts else "guide"
        lines = len(path.read_text().splitlines())
        totals[kind] += lines
        out.append(f"| {path.relative_to(root)} | {kind} | {lines} |")
    out.append(f"| **guides** | | {totals['guide']} |")
    out.append(f"| **history** | | {totals['history']} |")
    return out


def comment_lines(path: Path):
    """(line number, text) of a source file's comments and docstrings."""
    text = path.read_text()
    if path.suffix == ".py":
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.COMMENT:
                yield token.start[0], token.string
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body
                if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                        and isinstance(body[0].value.value, str):
                    for offset, line in enumerate(body[0].value.value.splitlines()):
                        yield body[0].lineno + offset, line
        return
    in_block = False
    for number, line in enumerate(text.splitlines(), 1):
        if in_block or "//" in line or "/*" in line:
            yield number, line
        if "/*" in line:
            in_block = "*/" not in line.split("/*", 1)[1]
        elif "*/" in line:
            in_block = False


def session_section(root: Path) -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*")):
            if path.suffix in (".py", ".c", ".cu", ".cuh", ".metal") and path.is_file():
                found += [f"  {path.relative_to(root)}:{n}: {line.strip()}"
                          for n, line in comment_lines(path) if re.search(r"session", line, re.I)]
    numbered = [f for f in found if re.search(r"session\s+\d|_s\d\d\b", f, re.I)]
    return [f"comment/docstring lines naming 'session': {len(found)} ({len(numbered)} with a number)", *found]


def bench_section(root: Path) -> list[str]:
    scripts = [p for p in (root / "bench").iterdir() if p.suffix in (".py", ".cu") and p.is_file()]
    results = [p for p in (root / "bench" / "results").rglob("*") if p.is_file()]
    by_place = Counter("history" if "history" in p.relative_to(root / "bench" / "results").parts
                       else "cuda" if p.relative_to(root / "bench" / "results").parts[0] == "cuda" else "cpu"
                       for p in results)
    return [f"bench scripts (bench/*.py, bench/*.cu): {len(scripts)}",
            f"result files (bench/results/**): {len(results)} "
            f"(this CPU {by_place['cpu']}, cuda/ {by_place['cuda']}, history/ {by_place['history']})"]


def test_count(root: Path, python: str) -> str:
    with tempfile.TemporaryDirectory() as ns:
        (Path(ns) / "lockstep").mkdir()
        for package in PACKAGES:
            os.symlink(root / package, Path(ns) / "lockstep" / package)
        env = dict(os.environ, PYTHONPATH=ns)
        done = subprocess.run([python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                              cwd=root, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if re.search(r"\d+ tests? collected|collected", line)]
    return lines[-1] if lines else f"(collection failed, exit {done.returncode}: {done.stdout[-300:]}{done.stderr[-300:]})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a lockstep checkout")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that collects the tests")
    parser.add_argument("--no-tests", action="store_true", help="skip the test count")
    args = parser.parse_args()
    root = args.path.resolve()
    commit = subprocess.run(["git", "log", "-1", "--format=%h %cd %s", "--date=iso"], cwd=root,
                            capture_output=True, text=True).stdout.strip()
    print(f"# structure of {root}\n{commit}\n")

    held, other = l_fields(root)
    names = Counter(name for _, name in held)
    print(f"## L: {len(held)} fields under {len(names)} names ({', '.join(f'{n} {c}' for n, c in sorted(names.items()))})")
    print("\n".join(f"  {where}" for where, _ in held))
    print("not L (same names):")
    print("\n".join(f"  {where}" for where in other))
    for package, counts in l_parameters(root).items():
        where = "server/ (not api/)" if package == "server" else "kernels/"
        print(f"parameters in {where} named " + ", ".join(f"{n} {counts[n]}" for n in L_PARAMETERS))

    print("\n## Files and import floors per package")
    print("\n".join(import_section(root, import_graph_code())))
    print("\n## Docs lines")
    print("\n".join(docs_section(root)))
    print("\n## Comments naming a session (server/, kernels/, models/)")
    print("\n".join(session_section(root)))
    print("\n## Bench")
    print("\n".join(bench_section(root)))
    if not args.no_tests:
        print("\n## Tests (pytest --collect-only -q)")
        print(test_count(root, args.python))


if __name__ == "__main__":
    main()
