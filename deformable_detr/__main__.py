"""The console script: `deformable-detr COMMAND [ARGS]` (or `python -m deformable_detr COMMAND [ARGS]`)
runs the command deformable_detr/commands/COMMAND.py, installed with the package, in any folder."""

import importlib
import sys

from .commands import COMMANDS, cli

USAGE = "usage: deformable-detr COMMAND [ARGS] (COMMAND --help: its arguments)\n\ncommands:\n" + "\n".join(
    f"  {name:<8} {what}" for name, what in COMMANDS.items()
)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    command, arguments = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: {command!r} is not a command\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    cli.INVOKED_AS = cli.CONSOLE_SCRIPT  # argparse's prog, in usage and error lines: `deformable-detr X`
    # nothing returned: the console script's sys.exit(main()) would print a command's value and exit 1
    importlib.import_module(f"deformable_detr.commands.{command}").main(arguments)


if __name__ == "__main__":
    main()
