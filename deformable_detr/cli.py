"""What every command shares: the run-time set-up, and bad input or a failure as one line.

    @entry_point
    def main(argv=None):
        args = ArgumentParser(...).parse_args(argv)

Run as a program (`python train.py`, `python -m deformable_detr.predict`), the command first sets up
the process (`runtime.setup`: BLAS, malloc; `@entry_point(runtime=False)` for the benchmarks, which
set up the processes they measure themselves); imported (the tests call `main(argv)`), it does not.
Whatever stops it becomes one line on stderr, `error: ...`, and an exit status:

- 2, a usage error (`UsageError`): an argument, a config file, key or value is wrong;
- 1, a failure of the work: a missing or unreadable file (weights, image, data), bad data, or
  anything else, whose type is then named. DEFORMABLE_DETR_TRACEBACK=1 adds the traceback;
- a `CommandError` carries its own status (a training run stopped by a signal: 128 + its number)."""

import argparse
import functools
import os
import sys
import traceback

TRACEBACK_VARIABLE = "DEFORMABLE_DETR_TRACEBACK"


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


class ArgumentParser(argparse.ArgumentParser):
    """argparse's, whose errors are UsageErrors: one line, exit status 2."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")


def entry_point(main=None, *, runtime: bool = True):
    """`@entry_point` or `@entry_point(runtime=False)` on a command's `main(argv=None)`."""
    if main is None:
        return functools.partial(entry_point, runtime=runtime)

    @functools.wraps(main)
    def command(argv=None):
        try:
            if runtime and main.__module__ == "__main__":
                from . import runtime as process

                process.setup()
            return main(argv)
        except (SystemExit, KeyboardInterrupt):
            raise
        except Exception as error:  # noqa: BLE001  (the one place every command's errors end)
            message, status = one_line(error)
            if os.environ.get(TRACEBACK_VARIABLE) == "1":
                traceback.print_exc()
            if status == 1:
                raise SystemExit(f"error: {message}") from None
            print(f"error: {message}", file=sys.stderr)
            raise SystemExit(status) from None

    return command


def one_line(error: Exception) -> tuple[str, int]:
    """-> (the message, the exit status) of what stopped a command."""
    if isinstance(error, CommandError):
        message, status = str(error), error.status
    elif isinstance(error, (FileNotFoundError, ValueError)) and str(error):
        message, status = str(error), 1
    else:
        message, status = f"{type(error).__name__}: {error} (set {TRACEBACK_VARIABLE}=1 for the traceback)", 1
    return " ".join(message.splitlines()), status
