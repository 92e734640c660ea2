"""The fine-tune example (bench/results/finetune_shapes.txt) with H-Deformable-DETR's recipe against without: each
fine-tunes its own quick-start model (bench/hybrid_quickstart.py's two runs) on the second shapes set, in equal
epochs, AP after each and the training seconds spent.

    python bench/hybrid_finetune.py [--runs-dir output/bench_hybrid] [--output bench/results/hybrid_finetune_cpu.txt]

Target: python -m deformable_detr.data.shapes data/shapes_new --classes circle square hexagon star --seed 7
--train 200 --val 100 (made if missing), as the fine-tune example. Each run: configs/shapes.yaml data.dataset=coco
data.path=data/shapes_new model.num_classes=auto schedule.epochs=6 schedule.lr_drop=5 --finetune <its quick-start
checkpoint>; each run with its recipe's keys (hybrid_quickstart.TWO_STAGE, RECIPE).
"""

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import report  # noqa: E402
from hybrid_quickstart import RECIPE, ROOT, TWO_STAGE, table, train  # noqa: E402

TARGET = ROOT / "data" / "shapes_new"
FINETUNE = [
    "data.dataset=coco",
    f"data.path={TARGET}",
    "model.num_classes=auto",
    "schedule.lr_drop=5",
]


def make_target():
    """The fine-tune example's set, made where it is missing."""
    if not (TARGET / "annotations").is_dir():
        make = [sys.executable, "-m", "deformable_detr.data.shapes", str(TARGET), "--classes", "circle", "square"]
        make += ["hexagon", "star", "--seed", "7", "--train", "200", "--val", "100"]
        subprocess.run(make, cwd=ROOT, check=True)


def finetune_each(runs: dict, runs_dir: Path) -> dict:
    """name -> (its recipe's keys, the folder under `runs_dir` of the quick-start run it starts from): each fine-tuned
    6 epochs on the target, FINETUNE's keys after the recipe's (the fine-tune's schedule wins) -> name -> its curve."""
    make_target()
    curves = {}
    for name, (recipe, start) in runs.items():
        overrides = recipe + FINETUNE + [f"--finetune={runs_dir / start / 'checkpoint.safetensors'}"]
        curves[name] = train(f"finetune {name}", overrides, 6, runs_dir)
    return curves


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "output" / "bench_hybrid")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "hybrid_finetune_cpu.txt")
    args = parser.parse_args()
    curves = finetune_each({"quick start": (TWO_STAGE, "quick_start"), "recipe": (RECIPE, "recipe")}, args.runs_dir)
    report(table(__doc__.split("\n\n")[0], curves["quick start"], curves["recipe"]), args.output)


if __name__ == "__main__":
    main()
