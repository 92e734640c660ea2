"""Evaluate a checkpoint on the val split with pycocotools (COCO box AP).

    python eval.py --config configs/r50.yaml --checkpoint W [--coco-path P] [--batch-size N] [--output-dir D]
                   [section.key=value ...]

W is a training checkpoint (train.py) or converted weights (python -m deformable_detr.convert).
Prints pycocotools' 12-line summary; writes eval_results.json (AP, AP50, ..., ARl) and
detections_val.json (COCO results format) to --output-dir (default: beside the checkpoint).
"""

import json
import sys
from pathlib import Path

from deformable_detr import load_config
from deformable_detr.cli import ArgumentParser, entry_point
from deformable_detr.data import build_dataset
from deformable_detr.data.classes import describe_match, match_classes
from deformable_detr.evaluation import evaluate, evaluation_batch_size, per_class_table
from deformable_detr.hub import is_hub, parse
from deformable_detr.visualize import pr_curves
from deformable_detr.weights import config_from_weights, load_trained_model


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", help="default: the config the weights record (a checkpoint's, or converted weights')"
    )
    parser.add_argument("--checkpoint", required=True, help="a weights file, or hf://ORG/NAME[@REVISION] on the Hub")
    parser.add_argument("--coco-path", help="overrides data.coco_path")
    parser.add_argument("--batch-size", type=int, help="default: schedule.micro_batch_size (2 where it is auto)")
    parser.add_argument("--output-dir", type=Path)
    parser.add_argument(
        "--raw-weights", action="store_true", help="the trained weights, not their EMA (where the file has one)"
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value, as for train.py")
    return parser.parse_args(argv)


def default_output_dir(checkpoint: str) -> Path:
    """Beside the checkpoint; for weights from the Hub, output/ORG--NAME."""
    return Path("output") / parse(checkpoint)[0].replace("/", "--") if is_hub(checkpoint) else Path(checkpoint).parent


@entry_point
def main(argv=None) -> dict:
    args = parse_args(argv)
    overrides = args.overrides + ([f"data.coco_path={args.coco_path}"] if args.coco_path else [])
    cfg = load_config(args.config, overrides) if args.config else config_from_weights(args.checkpoint, overrides)
    model, recorded_names = load_trained_model(args.checkpoint, cfg, raw=args.raw_weights)
    dataset = build_dataset("val", cfg.data)
    # the model's classes meet the dataset's by name (its ids may differ: YOLO's 0-based, VOC's sorted)
    class_map = match_classes(recorded_names, dataset.class_names())
    for message in describe_match(recorded_names, dataset.class_names(), class_map, dataset.annotation_file):
        print(message, file=sys.stderr)
    batch_size = args.batch_size or evaluation_batch_size(cfg)
    evaluation = evaluate(model, dataset, batch_size, cfg.data.num_workers, True, cfg.evaluation.backend, class_map)
    print(per_class_table(evaluation.stats))
    output_dir = args.output_dir or default_output_dir(args.checkpoint)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "detections_val.json").write_text(json.dumps(evaluation.detections))
    (output_dir / "eval_results.json").write_text(json.dumps(evaluation.stats, indent=2))
    pr_curves(evaluation.curves, output_dir / "pr_curves.png")
    print(
        f"wrote {', '.join(str(output_dir / n) for n in ('eval_results.json', 'detections_val.json', 'pr_curves.png'))}"
    )
    return evaluation.stats


if __name__ == "__main__":
    main()
