"""The console script: `deformable-detr COMMAND [ARGS]` (or `python -m deformable_detr COMMAND [ARGS]`)
runs `python -m deformable_detr.COMMAND [ARGS]`, installed with the package, in any folder."""

import importlib
import sys

# command -> what it does; each is the module deformable_detr.<command> with a main(argv)
COMMANDS = {
    "train": "train a model (--config r50, shapes, ... or a YAML file)",
    "eval": "COCO box AP of weights on a dataset's val split",
    "predict": "detect objects in images, folders and videos; draw them",
    "export": "weights to ONNX, an .mlxfn file, Hugging Face or the authors' .pth",
    "convert": "the authors' or Hugging Face weights to this package's",
    "check": "read a config's dataset as training would and list every problem",
    "serve": "an HTTP server of detections (the serve extra): JSON, batched, a page",
}
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
    sys.argv[0] = f"deformable-detr {command}"  # argparse's prog, in usage and error lines
    # nothing returned: the console script's sys.exit(main()) would print a command's value and exit 1
    importlib.import_module(f"deformable_detr.{command}").main(arguments)


if __name__ == "__main__":
    main()
