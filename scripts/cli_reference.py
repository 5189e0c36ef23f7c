"""Write the command-line reference (docs/cli.md) from braid's argument parser.

Every command, its help line and its flags, grouped as `braid <command> --help` groups them,
with each flag's value (metavar or choices), default and help. The flags are generated from
the settings' declarations (`braid.settings`), so this page is too:
`tests/test_docs.py::test_the_cli_reference_is_current` fails when it differs from what this
script writes.

    python scripts/cli_reference.py --out docs/cli.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from braid.cli import build_parser

HEADER = """\
# Command-line reference

Generated from braid's argument parser by `python scripts/cli_reference.py --out docs/cli.md`
(`tests/test_docs.py` checks that it is current); `braid <command> --help` prints the same.
Most flags are declared once, beside the setting they set (`braid/settings.py`,
`braid/config.py`, `braid/server/settings.py`, ...); the commands that launch ranks share the
engine's groups (parallel, kv cache, scheduler, switches, speculative, compile).
"""


def _cell(text: str) -> str:
    """Text fit for one cell of a markdown table."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _subcommands(parser: argparse.ArgumentParser):
    """(name, help line, parser) of each subcommand, in the order they were added."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help for choice in action._choices_actions}
    return [(name, helps.get(name) or "", sub) for name, sub in action.choices.items()]


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices:
        return " \\| ".join(f"`{choice}`" for choice in action.choices)
    metavar = action.metavar or (action.dest if not action.option_strings
                                 else action.dest.upper())
    if action.nargs in ("+", "*"):
        return f"`{metavar} ...`"
    return f"`{metavar}`"


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS) or action.required:
        return ""
    return f"`{action.default}`"


def _help(formatter: argparse.HelpFormatter, action: argparse.Action) -> str:
    """The help text, without the default that the settings append (it has its own column)."""
    text = formatter._expand_help(action) if action.help else ""
    default = action.default
    if default is not None and action.nargs != 0:
        for suffix in (f" (default {default})", f"default {default}"):
            if text.endswith(suffix):
                text = text[: -len(suffix)]
                break
    if action.required and action.option_strings:
        text = f"required. {text}" if text else "required"
    return _cell(text)


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return "(positional)"
    return ", ".join(f"`{name}`" for name in action.option_strings)


def command_section(name: str, help_line: str, sub: argparse.ArgumentParser) -> list[str]:
    lines = [f"## braid {name}", "", f"{help_line[:1].upper()}{help_line[1:]}.", ""]
    formatter = sub._get_formatter()
    for group in sub._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        # "optional arguments" before Python 3.10
        title = "options" if group.title == "optional arguments" else group.title
        lines.append(f"**{title}**" + (f": {group.description}" if group.description else ""))
        lines.append("")
        lines += ["| flag | value | default | what it does |", "| --- | --- | --- | --- |"]
        for action in actions:
            flag = _flag(action)
            value = _value(action)
            if not action.option_strings:
                flag, value = value, ""
            lines.append(f"| {flag} | {value} | {_default(action)} | {_help(formatter, action)} |")
        lines.append("")
    return lines


def reference() -> str:
    """The markdown page."""
    parser = build_parser()
    commands = _subcommands(parser)
    lines = [HEADER, "| command | what it does |", "| --- | --- |"]
    for name, help_line, _ in commands:
        lines.append(f"| [`braid {name}`](#braid-{name}) | {_cell(help_line)} |")
    lines.append("")
    for name, help_line, sub in commands:
        lines += command_section(name, help_line, sub)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--out", default=None, help="write the page here (default: stdout)")
    out = args.parse_args(argv).out
    text = reference()
    if out is None:
        sys.stdout.write(text)
    else:
        Path(out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
