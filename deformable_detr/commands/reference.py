"""docs/commands.md, every command and every flag, written from the commands' parsers (each module's
`build_parser()`): `python -m deformable_detr.commands.reference > docs/commands.md` writes it, and
tests/test_command_reference.py fails when the page and the parsers differ.

The page is rendered here from each parser's arguments, not by argparse's help formatter, so it is the
same whatever the terminal's width and Python's release (their `--help` layouts differ: 3.13 writes an
option's aliases and metavar otherwise)."""

import argparse
import importlib

from . import COMMANDS
from .cli import CONSOLE_SCRIPT, OLD_SPELLINGS

WIDTH = 100  # the usage lines' width

INTRODUCTION = f"""# The commands

Every command and its flags, generated from the commands' parsers by
`python -m deformable_detr.commands.reference > docs/commands.md` (tests/test_command_reference.py fails
when they differ). Each runs as `{CONSOLE_SCRIPT} COMMAND` (the console script, installed with the package)
or `python -m deformable_detr.COMMAND`; `COMMAND --help` lists the same.

The commands that load a model (eval, predict, serve, export) name it alike: `--checkpoint` (a weights
file or hf://ORG/NAME), `--config` (default: the config the weights record), `--raw-weights` (not the
EMA), `--precision` where the model runs here (predict, serve, eval) and config overrides, written in every
command (train and check too) as positional `section.key=value` arguments, before or after the options
(predict's among its inputs: a path that exists is an input)."""


def argument_metavar(action: argparse.Action) -> str:
    """What follows an option (or stands for a positional), as argparse's usage line writes it."""
    if action.metavar is not None:
        names = action.metavar if isinstance(action.metavar, tuple) else (action.metavar,)
    elif action.choices is not None:
        names = ("{" + ",".join(str(choice) for choice in action.choices) + "}",)
    else:
        names = (action.dest.upper() if action.option_strings else action.dest,)
    name = names[0]
    if action.nargs is None:
        return name
    if action.nargs == "?":
        return f"[{name}]"
    if action.nargs == "*":
        return f"[{name} ...]"
    if action.nargs == "+":
        return f"{name} [{name} ...]"
    if isinstance(action.nargs, int):
        return " ".join(names if len(names) == action.nargs else names * action.nargs)
    raise ValueError(f"{action.dest}: nargs {action.nargs!r} is not rendered")


def invocation(action: argparse.Action) -> str:
    """`--flag METAVAR` (its first spelling) or the positional's metavar."""
    if not action.option_strings:
        return argument_metavar(action)
    return " ".join(filter(None, [action.option_strings[0], argument_metavar(action) if action.nargs != 0 else ""]))


def shown(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The arguments --help lists (not -h, nor those whose help is hidden: the old spellings)."""
    return [a for a in parser._actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]


def usage(command: str, parser: argparse.ArgumentParser) -> str:
    """The command's synopsis, wrapped at WIDTH: the options (optional ones in brackets; one of a group
    as [A | B]), then the positionals."""
    head, parts, grouped = f"{CONSOLE_SCRIPT} {command}", [], set()
    actions = shown(parser)
    for action in [a for a in actions if a.option_strings]:
        group = next((g for g in parser._mutually_exclusive_groups if action in g._group_actions), None)
        if group is not None:
            if id(group) not in grouped:
                grouped.add(id(group))
                parts.append("[" + " | ".join(invocation(a) for a in group._group_actions) + "]")
        else:
            parts.append(invocation(action) if action.required else f"[{invocation(action)}]")
    parts += [invocation(a) for a in actions if not a.option_strings]
    lines, line = [], head
    for part in parts:
        if len(line) + 1 + len(part) > WIDTH and line.strip():
            lines.append(line)
            line = " " * len(head)
        line += " " + part
    return "\n".join([*lines, line])


def default_of(action: argparse.Action) -> str:
    if action.required and action.nargs not in ("?", "*"):  # argparse marks some `*` positionals required
        return "required"
    if action.nargs == 0 or action.default in (None, [], argparse.SUPPRESS):
        return ""
    return f"`{' '.join(map(str, action.default)) if isinstance(action.default, list) else action.default}`"


def table(parser: argparse.ArgumentParser) -> list[str]:
    """A row per argument, the positionals first (as --help lists them)."""
    rows = ["| argument | default | what it is |", "| --- | --- | --- |"]
    actions = shown(parser)
    for action in [a for a in actions if not a.option_strings] + [a for a in actions if a.option_strings]:
        spelled = ", ".join(f"`{name}`" for name in action.option_strings[1:])
        aliases = f" (also {spelled})" if spelled else ""
        what = (action.help or "").replace("|", "\\|").replace("<", "&lt;")
        rows.append(f"| `{invocation(action)}`{aliases} | {default_of(action)} | {what} |")
    return rows


def command_section(command: str) -> str:
    parser = importlib.import_module(f"{__package__}.{command}").build_parser()
    lines = [f"## {command}", "", f"{COMMANDS[command]}.", "", "```", usage(command, parser), "```", ""]
    if parser.description:
        lines += [" ".join(parser.description.split()), ""]
    return "\n".join([*lines, *table(parser)])


def command_reference() -> str:
    """docs/commands.md's text."""
    old = ["## Old spellings", "", "They work in this release, each with a note on stderr naming the new one.", ""]
    old += ["| old | new |", "| --- | --- |", *(f"| `{was}` | `{now}` |" for was, now in OLD_SPELLINGS.items())]
    sections = [INTRODUCTION, *(command_section(command) for command in COMMANDS), "\n".join(old)]
    return "\n\n".join(sections) + "\n"


if __name__ == "__main__":
    print(command_reference(), end="")
