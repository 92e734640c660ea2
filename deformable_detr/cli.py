"""What every command shares: bad input or a failure as one line.

    @entry_point
    def main(argv=None):
        args = ArgumentParser(...).parse_args(argv)

Whatever stops a command becomes one line on stderr, `error: ...`, and an exit status:

- 2, a usage error (`UsageError`): an argument, a config file, key or value is wrong;
- 1, a failure of the work: a missing or unreadable file (weights, image, data), bad data, or
  anything else, whose type is then named. DEFORMABLE_DETR_TRACEBACK=1 adds the traceback;
- a `CommandError` carries its own status (a training run stopped by a signal: 128 + its number)."""

import argparse
import functools
import os
import sys
import traceback

from .errors import CommandError, UsageError
from .models.precision import INFERENCE_PRECISIONS

TRACEBACK_VARIABLE = "DEFORMABLE_DETR_TRACEBACK"


class ArgumentParser(argparse.ArgumentParser):
    """argparse's, whose errors are UsageErrors: one line, exit status 2."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")


def entry_point(main):
    """`@entry_point` on a command's `main(argv=None)`."""

    @functools.wraps(main)
    def command(argv=None):
        try:
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


def add_precision(parser: argparse.ArgumentParser, default: str):
    """--precision, as predict, eval and serve take it (models/precision.py)."""
    parser.add_argument(
        "--precision",
        choices=INFERENCE_PRECISIONS,
        default=default,
        help=f"the products' precision (default {default}): auto is bfloat16 on a CPU with bfloat16 instructions "
        "(AMX-BF16, AVX512-BF16) and oneDNN, float32 elsewhere",
    )


def say_precision(detector):
    """The precision a command's detector runs at, and why: one line on stderr."""
    print(f"precision: {detector.precision} ({detector.precision_reason})", file=sys.stderr)


def one_line(error: Exception) -> tuple[str, int]:
    """-> (the message, the exit status) of what stopped a command."""
    if isinstance(error, CommandError):
        message, status = str(error), error.status
    elif isinstance(error, (FileNotFoundError, ValueError)) and str(error):
        message, status = str(error), 1
    else:
        message, status = f"{type(error).__name__}: {error} (set {TRACEBACK_VARIABLE}=1 for the traceback)", 1
    return " ".join(message.splitlines()), status
