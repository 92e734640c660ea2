"""The commands, one module each, on top of everything else: `deformable-detr COMMAND` (the console
script, `__main__.py`), `python -m deformable_detr.COMMAND` (a one-line module beside this package that
runs the same `main`), or `main(argv)` from Python.

mlx-lm's way, in a package of their own: a module per command (its argument parser, `build_parser()`,
its `main`, the glue that is its alone) and beside them what they share: `cli.py` (the usage line's
name; the flags of every command that loads a model, its `Detector`, the config overrides written one
way), `reference.py` (docs/commands.md, from the parsers) and `predict_video.py` (predict's videos).
What a command does is elsewhere, where `Detector`, tests and users can call it: training in `training/`,
inference in `inference/`, a dataset's audit in `data/`; so nothing below imports a command.

COMMANDS: each command's one-line summary, as `deformable-detr --help` lists them."""

COMMANDS = {
    "train": "train a model (--config r50, shapes, ... or a YAML file)",
    "eval": "COCO box AP of weights on a dataset's val split",
    "predict": "detect objects in images, folders and videos; draw them",
    "export": "weights to ONNX, an .mlxfn file, Hugging Face or the authors' .pth",
    "convert": "the authors' or Hugging Face weights to this package's",
    "check": "read a config's dataset as training would and list every problem",
    "serve": "an HTTP server of detections (the serve extra): JSON, batched, a page",
}
