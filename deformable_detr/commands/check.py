"""Read a config's dataset as training would, without training: every annotation of the train and val
splits, and every image decoded fully as training decodes it (in a few threads; `--headers-only`: the
headers alone, fast, but blind to truncated data). Print images and boxes per class, the boxes training
drops, and every problem found (each a line naming the file and line, or annotation, or image id).
Notes, which do not stop training: annotations of no listed image, images listed twice, recorded sizes
other than the image's, EXIF-turned images and the frame each is read in, classes without boxes, class
names merged from several spellings.

    python -m deformable_detr.check --config CFG [--headers-only] [section.key=value ...]

Exit status 1 when a problem would stop training (train.py stops at the first), else 0. The audit is
`deformable_detr/data/audit.py`'s `check_split` (a `Report` a split); this command prints it."""

from pathlib import Path

from ..config import load_config
from ..data import build_dataset, data_path
from ..data.audit import Report, check_split
from ..errors import CommandError, entry_point
from ..models.combinations import check_model
from .cli import OVERRIDE_HELP, command_parser, split_overrides

SPLITS = ("train", "val")


def print_report(split: str, dataset, report: Report):
    if dataset is None:
        print(f"{split}: cannot be read")
    else:
        names = dataset.class_names()
        total = sum(report.boxes.values())
        print(f"{split}: {report.images} images, {total} boxes ({dataset.annotation_file})")
        print(f"  {'id':>5}  {'class':<24} {'images':>8} {'boxes':>8}")
        for category in sorted(set(names) | set(report.boxes)):
            images = len(report.images_per_class.get(category, ()))
            name = names.get(category, "(not in the category list)")
            print(f"  {category:>5}  {name:<24} {images:>8} {report.boxes[category]:>8}")
        print(f"  crowd or difficult boxes (evaluated, not trained on): {report.crowd}")
        dropped = ", ".join(f"{n} {reason} (first: {where})" for reason, (n, where) in report.dropped.items())
        print(f"  boxes dropped as training drops them: {dropped or 'none'}")
    for note in report.notes:
        print(f"  note: {note}")
    for problem in report.problems:
        print(f"  problem: {problem}")


def build_parser():
    """check's parser (docs/commands.md is generated from it)."""
    parser = command_parser("check", __doc__)
    parser.add_argument("--config", required=True, help="a YAML file, or a shipped config's name (r50, shapes, ...)")
    parser.add_argument(
        "--headers-only", action="store_true", help="read image headers only (fast; misses truncated image data)"
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help=f"{OVERRIDE_HELP}, e.g. data.path=..."
    )
    return parser


@entry_point
def main(argv=None):
    args = build_parser().parse_intermixed_args(argv)  # overrides before and after the options
    cfg = load_config(args.config, split_overrides(args.overrides)[0])  # written as in every command (cli.py)
    check_model(cfg.model)  # a model training could not build: said before the data is read
    print(f"data.dataset {cfg.data.dataset}, at {data_path(cfg.data)}")
    if cfg.data.dataset == "shapes" and not (Path(data_path(cfg.data)) / "annotations").exists():
        print(
            f"the shapes set is generated where it is absent, as training does: generating it in {data_path(cfg.data)}"
        )
        build_dataset("train", cfg.data, prepare=True)
    problems = 0
    for split in SPLITS:
        dataset, report = check_split(split, cfg.data, decode=not args.headers_only)
        print_report(split, dataset, report)
        problems += len(report.problems)
    if problems:
        raise CommandError(f"{problems} problem(s) found: training would stop at the first")
    print("no problems found")


if __name__ == "__main__":
    main()
