"""Evaluate a checkpoint on the val split with pycocotools (COCO box AP).

    deformable-detr eval --checkpoint W [--config C] [--raw-weights] [--precision P] [--data-path P]
                         [--batch-size N] [--threshold T] [--output-dir D] [section.key=value ...]

(also `python -m deformable_detr.eval`, or a checkout's `python eval.py`).

W is a training checkpoint (train.py) or converted weights (python -m deformable_detr.convert), or
hf://ORG/NAME. The model's classes meet the dataset's by name. Prints pycocotools' 12-line summary;
writes eval_results.json (AP, AP50, ..., ARl, per_class, ground_truth: the boxes evaluated and those
left out as training drops them, and confusion_matrix: the detections scoring at least --threshold
against the boxes, at IoU 0.5, with a background row and column: inference/confusion.py),
detections_val.json (COCO results format), pr_curves.png and confusion_matrix.png to --output-dir
(default: beside the checkpoint). Built on `Detector.evaluate`.
"""

from pathlib import Path

from ..errors import entry_point
from ..inference.confusion import THRESHOLD
from ..inference.evaluation import per_class_table
from ..weights.hub import is_hub, parse
from .cli import add_model_arguments, command_parser, load_detector, split_overrides


def build_parser():
    """eval's parser (docs/commands.md is generated from it)."""
    parser = command_parser("eval", __doc__)
    add_model_arguments(parser, precision="float32")  # AP is a reference number: float32 unless asked
    parser.add_argument(
        "--data-path", "--coco-path", help="where the dataset is (data.path: a folder, or YOLO's data.yaml)"
    )
    parser.add_argument("--batch-size", type=int, help="default: schedule.micro_batch_size (2 where it is auto)")
    parser.add_argument(
        "--threshold",
        type=float,
        default=THRESHOLD,
        help=f"the confusion matrix counts the detections scoring at least this (default {THRESHOLD}, the pictures')",
    )
    parser.add_argument("--output-dir", type=Path, help="default: beside the checkpoint (output/ORG--NAME for hf://)")
    return parser


def parse_args(argv=None):
    args = build_parser().parse_intermixed_args(argv)  # overrides before and after the options
    args.overrides = split_overrides(args.overrides)[0]
    return args


def default_output_dir(checkpoint: str) -> Path:
    """Beside the checkpoint; for weights from the Hub, output/ORG--NAME."""
    return Path("output") / parse(checkpoint)[0].replace("/", "--") if is_hub(checkpoint) else Path(checkpoint).parent


@entry_point
def main(argv=None) -> dict:
    args = parse_args(argv)
    detector = load_detector(args)
    output_dir = args.output_dir or default_output_dir(args.checkpoint)
    stats = detector.evaluate(
        args.data_path, batch_size=args.batch_size, output_dir=output_dir, verbose=True, threshold=args.threshold
    )
    print(per_class_table(stats))
    written = ["eval_results.json", "detections_val.json", "pr_curves.png"]
    written += ["confusion_matrix.png"] if "confusion_matrix" in stats else []
    print(f"wrote {', '.join(str(output_dir / name) for name in written)}")
    return stats


if __name__ == "__main__":
    main()
