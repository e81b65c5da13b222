"""docs/CLI.md, rendered from the `lockstep` argparse tree (server/cli.py `build_parser()`).

`python -m lockstep.server.tools.cli_doc > docs/CLI.md` refreshes it; tests/test_cli_doc.py
fails when the file in the tree is not what this renders. Only the parsers' own text goes in,
never the terminal width or the environment, so the output is the same on every machine.
"""
from __future__ import annotations

import argparse
import sys

REFRESH = "python -m lockstep.server.tools.cli_doc > docs/CLI.md"

HEADER = f"""# `lockstep` command line

Every subcommand with its flags, defaults and help, generated from the parsers themselves
(`server/cli.py`). Do not edit by hand: `{REFRESH}` rewrites it, and
`tests/test_cli_doc.py` fails while it differs. `lockstep <command> --help` prints the same.
"""


def _cell(text: str) -> str:
    """One table cell: argparse help is free text over several source lines; a `|` would
    end the cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%" in text:
        # argparse expands %(default)s and friends the same way when it prints --help
        params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
        params["prog"] = ""
        text = text % params
    return text


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest.upper()}`"
    names = ", ".join(action.option_strings)
    if action.nargs == 0:
        return f"`{names}`"
    if action.choices is not None and action.metavar is None:
        return f"`{names} {{{','.join(map(str, action.choices))}}}`"
    return f"`{names} {action.metavar or action.dest.upper()}`"


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.nargs == 0 or action.default in (None, [], argparse.SUPPRESS):
        # a switch's default is "off"; None and [] mean "not given" (the help says what then)
        return ""
    return f"`{action.default}`"


def _description(action: argparse.Action) -> str:
    text = _help(action)
    if isinstance(action, argparse._AppendAction) and "repeatable" not in text:
        text = f"{text} (repeatable)" if text else "repeatable"
    return _cell(text)


def _table(actions: list[argparse.Action]) -> list[str]:
    first = "flag" if actions[0].option_strings else "argument"
    rows = [f"| {first} | default | description |", "|---|---|---|"]
    for action in actions:
        rows.append(f"| {_flag(action)} | {_default(action)} | {_description(action)} |")
    return rows


def _subcommands(parser: argparse.ArgumentParser):
    """(name, help, subparser) for each subcommand of `parser`, in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name), sub


def _usage(prog: str, parser: argparse.ArgumentParser) -> str:
    parts = [prog]
    if any(a.option_strings and not isinstance(a, argparse._HelpAction) for a in parser._actions):
        parts.append("[options]")
    for action in parser._actions:
        if action.option_strings:
            continue
        if isinstance(action, argparse._SubParsersAction):
            parts.append("{" + ",".join(action.choices) + "} ...")
            continue
        word = action.metavar or action.dest.upper()
        parts.append(f"{word} [{word} ...]" if action.nargs == "+" else word)
    return " ".join(parts)


def _sentence(text: str) -> str:
    text = _cell(text)
    return text[0].upper() + text[1:].rstrip(".") + "."


def _options(parser: argparse.ArgumentParser) -> list[str]:
    """A table per argument group (`bench` has a group of its own for its HTTP load)."""
    lines = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
                   and a.help is not argparse.SUPPRESS]
        if not actions:
            continue
        title = {"positional arguments": "Arguments", "options": "Options"}.get(group.title, group.title)
        lines += [f"{title[0].upper() + title[1:]}:", ""] + _table(actions) + [""]
    return lines


def _section(prog: str, summary: str | None, parser: argparse.ArgumentParser, level: int) -> list[str]:
    lines = [f"{'#' * level} `{prog}`", ""]
    lines += [_sentence(text) + "\n" for text in (summary, parser.description) if text]
    lines += ["```", _usage(prog, parser), "```", ""] + _options(parser)
    for name, help_text, sub in _subcommands(parser):
        lines += _section(f"{prog} {name}", help_text, sub, level + 1)
    return lines


def render(parser: argparse.ArgumentParser | None = None) -> str:
    if parser is None:
        from lockstep.server.cli import build_parser

        parser = build_parser()
    lines = [HEADER]
    names = [name for name, _, _ in _subcommands(parser)]
    lines += ["Commands: " + ", ".join(f"[`{n}`](#lockstep-{n})" for n in names) + ".", ""]
    # the top-level parser's own description is about the code (one module per command)
    lines += ["```", _usage("lockstep", parser), "```", ""] + _options(parser)
    for name, help_text, sub in _subcommands(parser):
        lines += _section(f"lockstep {name}", help_text, sub, 2)
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
