"""The errors whose message is for the user, and how a command line prints them: one line.

    @entry_point
    def main(argv=None):
        args = ArgumentParser(...).parse_args(argv)

Whatever stops a command (the package's, a data generator's, a bench script's) becomes one line on
stderr, `error: ...`, and an exit status:

- 2, a usage error (`UsageError`): an argument, a config file, key or value, or an environment variable
  (docs/settings.md, read as the command starts) is wrong;
- 1, a failure of the work: a missing or unreadable file (weights, image, data), bad data, or
  anything else, whose type is then named. DEFORMABLE_DETR_TRACEBACK=1 adds the traceback;
- a `CommandError` carries its own status (a training run stopped by a signal: 128 + its number).

The errors:

- `UsageError`: what the user typed is wrong (an argument, a config file, key or value): exit 2;
- `CommandError`: a failure of the work, with its exit status (1, or 128 + a signal's number);
- `ConversionError`: weights that cannot be converted; the message names the file and key;
- `WriteError`: a file that could not be written, named with the system's reason (exit 1).

`install_hint(extra)` is the pip command that installs an extra where the package runs from."""

import argparse
import functools
import importlib
import os
import re
import sys
import traceback
from pathlib import Path

from .settings import ALL_SETTINGS, TRACEBACK

DISTRIBUTION = "deformable-detr-mlx"
PACKAGE_DIR = Path(__file__).resolve().parent  # deformable_detr/: a checkout's pyproject.toml is beside it


DECIMAL = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+")  # a decimal as typed: ASCII digits, no sign, exponent, inf, nan
QUOTED_CHARACTERS = 40  # what a message quotes of a value a user or a client sent, at most


def quoted(text: str) -> str:
    """`text` as a message quotes a user's or a client's input: repr of its first QUOTED_CHARACTERS, '…' where cut."""
    return repr(text) if len(text) <= QUOTED_CHARACTERS else repr(text[:QUOTED_CHARACTERS]) + "…"


class CommandError(Exception):
    """A stop whose message is for the user, with the command's exit status."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


class UsageError(CommandError, ValueError):
    """What the user typed is wrong: an argument, a config file, key or value (exit status 2, as
    argparse's)."""

    def __init__(self, message: str):
        super().__init__(message, 2)


class ConversionError(ValueError):
    """A checkpoint that cannot be converted; the message says which file and key."""


class WriteError(CommandError):
    """A file that could not be written: `path` and the system's `reason` ("No space left on device");
    the file there before, if any, is as it was (every weights file is written beside it and renamed)."""

    def __init__(self, path, reason: str):
        super().__init__(f"{path}: cannot write it: {reason}")
        self.path, self.reason = path, reason


class ArgumentParser(argparse.ArgumentParser):
    """argparse's, whose errors are UsageErrors: one line, exit status 2."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")


def entry_point(main):
    """`@entry_point` on a command's `main(argv=None)`."""

    @functools.wraps(main)
    def command(argv=None):
        show_traceback = False
        try:
            show_traceback = settings_read()
            return main(argv)
        except (SystemExit, KeyboardInterrupt):
            raise
        except Exception as error:  # noqa: BLE001  (the one place every command's errors end)
            message, status = one_line(error)
            if show_traceback:
                traceback.print_exc()
            if status == 1:
                raise SystemExit(f"error: {message}") from None
            print(f"error: {message}", file=sys.stderr)
            raise SystemExit(status) from None

    return command


def settings_read() -> bool:
    """Every environment variable of the two packages (settings.py) read as a command starts, so that a bad value
    is a usage error before any work. -> DEFORMABLE_DETR_TRACEBACK's value."""
    try:
        values = {setting.name: setting.value() for setting in ALL_SETTINGS}
    except ValueError as bad:
        raise UsageError(str(bad)) from None
    return values[TRACEBACK.name]


def one_line(error: Exception) -> tuple[str, int]:
    """-> (the message, the exit status) of what stopped a command."""
    if isinstance(error, CommandError):
        message, status = str(error), error.status
    elif isinstance(error, (FileNotFoundError, ValueError)) and str(error):
        message, status = str(error), 1
    else:
        message, status = f"{type(error).__name__}: {error} (set {TRACEBACK.name}=1 for the traceback)", 1
    return " ".join(message.splitlines()), status


class MissingExtra(CommandError):
    """An optional package is not installed: `optional`'s one line."""


def optional(module: str, extra: str, needed_for: str):
    """`module` imported (a dotted name too), or MissingExtra: `{needed_for} needs {package}, in the "{extra}" extra:
    {pip line}`. The one way every optional dependency is asked for (tests/test_install_hints.py walks them): a
    caller that can do without it catches MissingExtra and says its line."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package = (error.name or module).split(".")[0]
        raise MissingExtra(f'{needed_for} needs {package}, in the "{extra}" extra: {install_hint(extra)}') from None


def install_hint(extra: str, package_dir: Path | None = None) -> str:
    """The pip command that installs `extra` where the package (in `package_dir`, default this one)
    runs from: in a source checkout (an editable install, or the repository on sys.path) `pip install -e`
    of it, by its path unless it is the current directory; else the distribution's extra from the index,
    as `pip install -e ".[extra]"` fails outside a checkout ("does not appear to be a Python project")."""
    checkout = source_checkout(package_dir)
    if checkout is None:
        return f'pip install "{DISTRIBUTION}[{extra}]"'
    where = "." if _is_cwd(checkout) else checkout  # "." only works from the checkout itself
    return f'pip install -e "{where}[{extra}]"'


def source_checkout(package_dir: Path | None = None) -> Path | None:
    """The folder above `package_dir` (default this package's) where its pyproject.toml is this
    project's, else None."""
    root = Path(package_dir or PACKAGE_DIR).parent
    return root if _project_name(root / "pyproject.toml") == DISTRIBUTION else None


def _project_name(pyproject: Path) -> str | None:
    """The [project] table's name in `pyproject`, or None (no such file or name). A line scan, not
    tomllib: that is Python 3.11+, and the package supports 3.10."""
    try:
        lines = pyproject.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    table = None
    for line in lines:
        if line.startswith("["):
            table = line.split("#")[0].strip()
        elif table == "[project]" and (name := re.match(r"""name\s*=\s*["']([^"']+)["']""", line)):
            return name.group(1)
    return None


def _is_cwd(folder: Path) -> bool:
    try:
        return os.path.samefile(folder, os.getcwd())
    except OSError:  # the current directory was deleted
        return False
