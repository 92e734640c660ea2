"""What every command shares: the run-time set-up, and errors as one line.

    @entry_point
    def main(argv=None): ...

Run as a program (`python train.py`, `python -m deformable_detr.predict`), the command first sets up
the process (`runtime.setup`: MKL, malloc); imported (the tests call `main(argv)`), it does not.
Whatever stops it becomes one line on stderr, `error: ...`, and an exit status: `CommandError`s
carry theirs; a missing file or a bad value (FileNotFoundError, ValueError) is 1; anything else is
1 too, its type named, with the traceback shown only when DEFORMABLE_DETR_TRACEBACK=1."""

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


def entry_point(main):
    @functools.wraps(main)
    def command(argv=None):
        if main.__module__ == "__main__":
            from . import runtime

            runtime.setup()
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


def one_line(error: Exception) -> tuple[str, int]:
    """-> (the message, the exit status) of what stopped a command."""
    if isinstance(error, CommandError):
        return str(error), error.status
    if isinstance(error, (FileNotFoundError, ValueError)) and str(error):
        return str(error), 1
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return f"{text} (set {TRACEBACK_VARIABLE}=1 for the traceback)", 1
