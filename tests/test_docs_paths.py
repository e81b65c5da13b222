"""Every file path the guides name exists: docs/*.md, README.md, bench/README.md and
tests/gpu/README.md, and the paths that comments and docstrings name (server/, kernels/,
models/, tests/, bench/).

A path is a token ending in a file suffix (.py, .md, .cu, ...). With a folder in front, it is
found from the repository root, from the naming file's folder, or from a folder of that name in
the tree (`engine/passes.py` is looked for as `server/engine/passes.py`); a path whose first
folder the tree has nowhere is someone else's (`mlx/backend/...`, `OUT/...`) and not checked.
A bare file name (`stops.py`) must be some file's name. DESIGN.md's Layout tables name their
files from the folder set above each table (`` `server/engine/scheduling/` ``), so a row's
path is found from that folder only: a module that moved rooms leaves a row that fails.
"""
from __future__ import annotations

import fnmatch
import glob
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUIDES = ("docs/*.md", "README.md", "bench/README.md", "tests/gpu/README.md")
CODE = ("server", "kernels", "models", "tests", "bench")
SUFFIXES = "py|md|cu|cuh|metal|c|toml|txt"
PATH = re.compile(rf"(?<![\w./*-])((?:\.\./)*[\w*.-]+(?:/[\w*.-]+)*\.(?:{SUFFIXES}))(?![\w/])")
# a line that sets the folder a Layout table's rows are named from: `server/engine/` or **models/**
TABLE_BASE = re.compile(r"^(?:`([\w./-]+/)`|\*\*([\w./-]+/)\*\*)")


def tree_files(root: Path) -> list[str]:
    """The tracked and untracked (not ignored) files, as repository paths; outside a git
    checkout (a `git archive` copy), every file but hidden folders' and caches'."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, text=True)
    if listed.returncode == 0:
        return [p for p in listed.stdout.split() if (root / p).exists()]
    return [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()
            and not any(part.startswith(".") or part == "__pycache__" for part in p.relative_to(root).parts)]


class Tree:
    def __init__(self, root: Path, files: list[str]):
        self.root = root
        self.files = set(files)
        self.names = {Path(p).name for p in files}
        self.dirs = {str(parent) for p in files for parent in Path(p).parents if str(parent) != "."}

    def has(self, path: str) -> bool:
        """A file (or, with `*`, some file) at this repository path."""
        path = str(Path(path))
        if "*" in path:
            return any(True for _ in glob.iglob(str(self.root / path), recursive=True))
        return path in self.files or (self.root / path).is_file()

    def folders_named(self, name: str) -> list[str]:
        return [d for d in self.dirs if d == name or d.endswith("/" + name)]

    def found(self, token: str, naming_file: str, base: str | None = None) -> bool | None:
        """True: the path exists; False: it does not; None: not a path of this tree."""
        if base is not None:
            return self.has(base + token)
        if "/" not in token:
            if "*" in token:
                return any(fnmatch.fnmatch(name, token) for name in self.names)
            return token in self.names if not token.endswith(".txt") else None  # .txt: an output's name
        if self.has(token):
            return True
        if token.startswith(".."):
            try:
                path = (self.root / naming_file).parent.joinpath(token).resolve().relative_to(self.root.resolve())
            except ValueError:
                return None  # outside the repository
            return self.has(str(path)) if str(path.parent) in self.dirs else None
        if self.has(str(Path(naming_file).parent / token)):
            return True
        first, folder = token.split("/")[0], str(Path(token).parent)
        if (self.root / first).is_dir():
            return False  # named from the root: server/..., kernels/..., docs/...
        # named from a folder inside the tree (engine/passes.py): ours where that folder is
        places = [str(Path(place).parent / folder) for place in self.folders_named(first)]
        places = [p for p in places if p in self.dirs]
        if not places:
            return None
        return any(self.has(str(Path(place) / Path(token).name)) for place in places)

def stale_in_guide(tree: Tree, name: str, text: str) -> list[str]:
    stale = []
    base = None
    for number, line in enumerate(text.splitlines(), 1):
        set_base = TABLE_BASE.match(line)
        if set_base or line.startswith(("#", "**")):
            base = set_base and (set_base.group(1) or set_base.group(2))
        in_row = line.startswith("|") and base is not None
        first_cell = line.split("|")[1] if in_row and line.count("|") >= 2 else ""
        if in_row:
            for token in re.findall(r"`([^`]+)`", first_cell):
                for path in token.replace(",", " ").split():
                    if PATH.fullmatch(path) and not tree.found(path, name, base):
                        stale.append(f"{name}:{number}: {base}{path}")
        rest = line.replace(first_cell, "", 1) if first_cell else line
        for token in PATH.findall(rest):
            if tree.found(token, name) is False:
                stale.append(f"{name}:{number}: {token}")
    return stale


def stale_in_code(tree: Tree, name: str, text: str) -> list[str]:
    """Paths with a folder in the code's comments, docstrings and messages."""
    return [f"{name}:{number}: {token}" for number, line in enumerate(text.splitlines(), 1)
            for token in PATH.findall(line) if "/" in token and tree.found(token, name) is False]


def guide_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for pattern in GUIDES for p in root.glob(pattern))


def stale_paths(root: Path) -> list[str]:
    files = tree_files(root)
    tree = Tree(root, files)
    stale = []
    for name in guide_files(root):
        stale += stale_in_guide(tree, name, (root / name).read_text())
    own = str(Path(__file__).resolve().relative_to(ROOT))  # its control names moved paths on purpose
    for name in sorted(f for f in files if f.split("/")[0] in CODE and f.endswith(".py") and f != own):
        stale += stale_in_code(tree, name, (root / name).read_text())
    return stale


def test_every_path_the_docs_and_comments_name_exists():
    assert stale_paths(ROOT) == []


def test_the_check_sees_a_moved_module(tmp_path):
    """Control: a tree where a module moved rooms; the guide, a Layout row and a comment
    that still name the old place are each reported, and the new places are not."""
    for path, text in {
        "server/engine/scheduling/passes.py": '"""Read by server/engine/passes.py."""\n',
        "server/engine/engine.py": '"""Uses server/engine/scheduling/passes.py."""\n',
        "docs/DESIGN.md": ("`server/engine/`\n| path | job |\n|---|---|\n| `passes.py` | gone |\n"
                           "| `engine.py` | here |\n\n`server/engine/scheduling/`\n| path | job |\n"
                           "|---|---|\n| `passes.py` | here |\n\nSee engine/passes.py and mlx/backend/x.cu.\n"),
    }.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    assert stale_paths(tmp_path) == [
        "docs/DESIGN.md:4: server/engine/passes.py",
        "docs/DESIGN.md:12: engine/passes.py",
        "server/engine/scheduling/passes.py:1: server/engine/passes.py",
    ]
