"""docs/CLI.md is what server/tools/cli_doc.py renders from the `lockstep` parsers, now."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from lockstep.server.cli import build_parser
from lockstep.server.tools import cli_doc

ROOT = Path(__file__).resolve().parents[1]
CLI_MD = ROOT / "docs" / "CLI.md"


def test_docs_cli_md_is_current():
    # the refresh command itself, as a contributor runs it
    rendered = subprocess.run([sys.executable, "-m", "lockstep.server.tools.cli_doc"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout
    assert rendered == CLI_MD.read_text(), f"docs/CLI.md is stale; refresh it with: {cli_doc.REFRESH}"


def _parsers(parser: argparse.ArgumentParser, prog: str = "lockstep"):
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{prog} {name}")


def _section_of(text: str, prog: str) -> str:
    """The part of the page under `prog`'s heading, up to the next heading of any command."""
    start = text.index(f"# `{prog}`\n")
    end = text.find("\n#", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_every_subcommand_has_a_section_with_each_of_its_flags_defaults_and_help():
    text = cli_doc.render()
    for prog, parser in _parsers(build_parser()):
        section = text if prog == "lockstep" else _section_of(text, prog)
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            row = next((line for line in section.splitlines()
                        if line.startswith(f"| {cli_doc._flag(action)} |")), None)
            assert row is not None, f"{prog}: {action.option_strings or action.dest} has no row"
            if action.option_strings and action.nargs != 0 and action.default not in (None, []):
                assert f"| `{action.default}` |" in row, (prog, row)
            if action.help:
                assert " ".join(action.help.split()).replace("|", "\\|") in row, (prog, row)


def test_a_pipe_in_help_stays_inside_its_cell():
    parser = argparse.ArgumentParser(prog="x")
    parser.add_argument("--mode", default="a", help="a|b, one of")
    row = cli_doc._table(parser._actions[1:])[2]
    assert row == "| `--mode MODE` | `a` | a\\|b, one of |"


def test_the_readme_points_at_the_full_flag_list():
    assert "(docs/CLI.md)" in (ROOT / "README.md").read_text()
