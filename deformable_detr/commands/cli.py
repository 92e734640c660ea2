"""What the commands share beyond `errors.entry_point`: the name a command goes by in its usage line,
the arguments of every command that loads a model, and how they build its `Detector`.

A command's `prog` is the way it was started: `deformable-detr X` through the console script
(`__main__.py` sets `INVOKED_AS`), else `python -m deformable_detr.X`, so `--help` and every usage error
show what the user typed.

One vocabulary for the commands that load a model (eval, predict, serve, export: `add_model_arguments`,
`load_detector`): `--checkpoint` (a weights file or hf://ORG/NAME), `--config` (default: the config the
weights record), `--raw-weights` (not the EMA), `--precision` where the command runs the model (predict
and serve: auto; eval: float32, AP being a reference number; export writes float32 graphs: none), and
config overrides. An override is written one way in every command, train and check included: a
positional `section.key=value` (`seed=N`), as train always took them, because
- it is the spelling most users already type (train, eval and check took it, and the YAML files name the
  same keys), and a flag repeated per key (`--set a=1 --set b=2`) is longer for nothing;
- it needs no flag of its own, so a command with other positionals (predict's inputs, export's
  destination) takes it too: `split_overrides` tells an override by its first part, a config section
  (config.py's `Config`: model, data, ...), and a path that exists is an input, never an override;
- one parser for all (`split_overrides`), whose errors are load_config's: `override 'x': expected
  section.key=value`, `override: shedule: unknown key; did you mean schedule?`.

The old spellings (`OLD_SPELLINGS`: `export SRC DST`, `predict --set KEY=VALUE`) work for one release
more, with a one-line note on stderr, once a run, naming the new one (`note_old_spelling`)."""

import argparse
import dataclasses
import re
import sys
from pathlib import Path

from ..config import Config, unknown_key
from ..errors import ArgumentParser, UsageError
from ..inference.detector import Detector
from ..models.precision import INFERENCE_PRECISIONS

CONSOLE_SCRIPT = "deformable-detr"
INVOKED_AS = None  # CONSOLE_SCRIPT where __main__.py runs the command
CONFIG_KEYS = [key.name for key in dataclasses.fields(Config)]  # an override's first part: model, ..., seed
OVERRIDE_HELP = "section.key=value: a config override (section: model, data, schedule, ...; or seed=N)"
OLD_SPELLINGS = {  # the old spelling -> the new one; both work this release
    "export SRC DST": "export --checkpoint SRC DST",
    "predict --set KEY=VALUE": "predict ... INPUT... section.key=value",
}
_noted = set()  # the old spellings noted in this run
_DOTTED_KEY = re.compile(r"[A-Za-z_]\w*(\.\w+)+")


def prog(command: str) -> str:
    """The usage line's name of `command` (train, eval, ...), as it was started."""
    return f"{CONSOLE_SCRIPT} {command}" if INVOKED_AS == CONSOLE_SCRIPT else f"python -m deformable_detr.{command}"


def command_parser(command: str, doc: str) -> ArgumentParser:
    """The parser of `command`, described by the first paragraph of its module's docstring `doc`."""
    return ArgumentParser(prog=prog(command), description=doc.split("\n\n")[0])


class Asked(argparse.Action):
    """Stores the option's value, and that it was given: `precision_asked`."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.precision_asked = True


def add_precision(parser, default: str):
    """--precision, as predict, eval and serve take it (models/precision.py)."""
    parser.set_defaults(precision_asked=False)  # where --precision is not given, the precision line says so
    parser.add_argument(
        "--precision",
        choices=INFERENCE_PRECISIONS,
        default=default,
        action=Asked,
        help=f"the products' precision (default {default}): auto runs in bfloat16 the products where it was "
        "measured faster on this CPU (oneDNN's AMX or AVX512-BF16 kernels), the rest in float32, and float32 "
        "throughout elsewhere, a GPU included; bfloat16 runs every product in bfloat16 where oneDNN has those "
        "kernels, float32 elsewhere; the precision line says what ran and why",
    )


def add_model_arguments(parser, precision: str | None = None, overrides: bool = True, checkpoint_required=True):
    """The arguments of a command that loads a model: --checkpoint, --config, --raw-weights, --precision
    (with its `precision` default; None: no such flag) and, with `overrides`, the positional config
    overrides (a command with positionals of its own adds `overrides`' place itself, as predict's inputs)."""
    parser.add_argument(
        "--checkpoint",
        required=checkpoint_required,
        metavar="WEIGHTS",
        help="a training checkpoint or converted weights (.safetensors), or hf://ORG/NAME[@REVISION] on the Hub",
    )
    parser.add_argument(
        "--config", help="a YAML file or a shipped config's name (default: the config the weights record)"
    )
    parser.add_argument(
        "--raw-weights", action="store_true", help="the trained weights, not their EMA (where the file has one)"
    )
    if precision is not None:
        add_precision(parser, precision)
    if overrides:
        parser.add_argument("overrides", nargs="*", metavar="section.key=value", help=OVERRIDE_HELP)


def split_overrides(tokens: list[str], others: bool = False) -> tuple[list[str], list[str]]:
    """(the config overrides among `tokens`, the rest), each in order. Without `others` every token must be
    an override, `key=value` (load_config checks the key). With `others` (predict's inputs) an override is
    `section.key=value` (or seed=N) of a config section; a path that exists, or a token not so shaped, is
    the command's; one shaped `name.name=...` of no config section an error naming the nearest section
    (`shedule.batch_size=4`), as load_config's."""
    overrides, rest = [], []
    for token in tokens:
        key, sep, _ = token.partition("=")
        if others and (not sep or not key or Path(token).exists()):
            rest.append(token)
        elif not sep or not key:
            raise UsageError(f"override {token!r}: expected section.key=value")
        elif not others or key.split(".")[0] in CONFIG_KEYS:
            overrides.append(token)  # a key of no section: load_config's error names it, as the one below
        elif not _DOTTED_KEY.fullmatch(key):
            rest.append(token)
        else:
            raise UsageError(f"override: {unknown_key(key.split('.')[0], CONFIG_KEYS, '')}")
    return overrides, rest


def note_old_spelling(old: str):
    """One line on stderr, once a run: `old` (an OLD_SPELLINGS key) works this release; the new spelling."""
    if old not in _noted:
        _noted.add(old)
        print(f"note: `{old}` is the old spelling, kept for one release; now: `{OLD_SPELLINGS[old]}`", file=sys.stderr)


def model_config(args) -> Config:
    """The config of the model `args` name (--checkpoint, --config, the overrides), before any weights are
    read: bad input is named before any work."""
    return Detector.config_for(args.checkpoint, args.config, args.overrides)


def load_detector(args, config: Config | None = None) -> Detector:
    """The `Detector` of `args` (add_model_arguments'; `config`: model_config's, already read), its
    precision said on stderr where the command has --precision."""
    options = {"precision": args.precision} if "precision" in vars(args) else {}
    config = args.config if config is None else config
    detector = Detector.load(args.checkpoint, config, args.overrides, raw_weights=args.raw_weights, **options)
    if options and not args.precision_asked:  # the command's default: said so, not "asked for"
        detector.precision = detector.precision.as_default()
    if options:
        say_precision(detector)
    return detector


def say_precision(detector):
    """The precision a command's detector runs at, and why: one line on stderr."""
    print(f"precision: {detector.precision}", file=sys.stderr)
