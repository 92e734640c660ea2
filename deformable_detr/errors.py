"""The errors whose message is for the user: every command prints them as one line (`cli.py`).

- `UsageError`: what the user typed is wrong (an argument, a config file, key or value): exit 2;
- `CommandError`: a failure of the work, with its exit status (1, or 128 + a signal's number);
- `ConversionError`: weights that cannot be converted; the message names the file and key;
- `WriteError`: a file that could not be written, named with the system's reason (exit 1)."""


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
