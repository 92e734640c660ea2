"""The fine-tune example (bench/results/finetune_shapes.txt) with DINO's recipe against the authors' two-stage model:
each fine-tunes its own model of bench/dino_quickstart.py (its 18-epoch two-stage and DINO N=20 runs) on the second
shapes set, in equal epochs, AP after each and the training seconds spent.

    python bench/dino_finetune.py [--runs-dir output/bench_dino] [--output bench/results/dino_finetune_cpu.txt]

Target and schedule as bench/hybrid_finetune.py's (the fine-tune example's set, 6 epochs, lr drop at 5); each run
with its own recipe's keys (hybrid_quickstart.TWO_STAGE, dino_quickstart.recipe(20)).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import report  # noqa: E402
from dino_quickstart import recipe  # noqa: E402
from hybrid_finetune import finetune_each  # noqa: E402
from hybrid_quickstart import ROOT, TWO_STAGE, at_seconds, table  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "output" / "bench_dino")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "dino_finetune_cpu.txt")
    args = parser.parse_args()
    curves = finetune_each({"two-stage": (TWO_STAGE, "two-stage"), "DINO": (recipe(20), "DINO_N=20")}, args.runs_dir)
    base, dino = curves["two-stage"], curves["DINO"]
    lines = table(__doc__.split("\n\n")[0], base, dino, ("two-stage", "DINO"))
    reached = at_seconds(dino, base[-1]["seconds"])
    lines += [
        "",
        f"equal epochs (6): two-stage AP {base[-1]['AP']:.3f}, DINO {dino[-1]['AP']:.3f}",
        f"equal time (the two-stage run's {base[-1]['seconds']:.0f} s): DINO at epoch {reached['epoch']} "
        f"({reached['seconds']:.0f} s) AP {reached['AP']:.3f}",
    ]
    report(lines, args.output)


if __name__ == "__main__":
    main()
