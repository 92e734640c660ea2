"""What the commands share beyond `errors.entry_point`: the name a command goes by in its usage line,
and the precision flag.

A command's `prog` is the way it was started: `deformable-detr X` through the console script
(`__main__.py` sets `INVOKED_AS`), else `python -m deformable_detr.X`, so `--help` and every usage error
show what the user typed."""

import sys

from ..errors import ArgumentParser
from ..models.precision import INFERENCE_PRECISIONS

CONSOLE_SCRIPT = "deformable-detr"
INVOKED_AS = None  # CONSOLE_SCRIPT where __main__.py runs the command


def prog(command: str) -> str:
    """The usage line's name of `command` (train, eval, ...), as it was started."""
    return f"{CONSOLE_SCRIPT} {command}" if INVOKED_AS == CONSOLE_SCRIPT else f"python -m deformable_detr.{command}"


def command_parser(command: str, doc: str) -> ArgumentParser:
    """The parser of `command`, described by the first paragraph of its module's docstring `doc`."""
    return ArgumentParser(prog=prog(command), description=doc.split("\n\n")[0])


def add_precision(parser, default: str):
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
