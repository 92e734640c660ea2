"""H-Deformable-DETR's recipe against today's quick start, on the quick start's own set: AP after each epoch and
the training seconds spent to reach it, so both compare in equal epochs and in equal wall time.

    python bench/hybrid_quickstart.py [--epochs 18] [--output bench/results/hybrid_quickstart_cpu.txt]

Two runs of `train.py --config shapes`, differing only in the recipe's keys (the quick start already has
dropout 0, two-stage and box refinement):
  quick start: the authors' two-stage model, the quick start when this was measured (TWO_STAGE on the command line:
               configs/shapes.yaml is DINO's since 2026-12-07), 18 epochs, lr drop at 14
  recipe:      + model.mixed_selection=true model.look_forward_twice=true, and the hybrid branch:
               model.num_queries_one2many=150 (5 x its 30 queries, as their 1,500 to 300), loss.k_one2many=6,
               loss.lambda_one2many=1.0
  recipe, the quick start's time: the recipe with its schedule shortened to the quick start's training time
               (--short-epochs, --short-lr-drop: 13 and 10 for a recipe step 1.35x the quick start's, the lr drop
               at the same share of the schedule)
  quick start, the recipe's time: the quick start's schedule lengthened to the recipe's 18 epochs' time
               (--long-epochs, --long-lr-drop: 25 and 19), so that each is given the other's time
The FFN stays at the quick start's 256: H-Deformable-DETR's own baseline has their FFN too, so their gain is the
recipe's, and so is this one. The seconds are the training steps' (log.jsonl's epoch records), not the evaluations';
run it on a quiet machine. Writes the table and a picture of the val curves (AP against training seconds) beside
the output.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, load_average, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# configs/shapes.yaml's keys as they were before it took DINO's recipe: the authors' two-stage model with box
# refinement (their position encoding, focal loss weight 2), 18 epochs with the lr drop at 14
TWO_STAGE = [
    "model.architecture=deformable_detr",
    "model.mixed_selection=false",
    "model.look_forward_twice=false",
    "model.position_temperature=10000",
    "model.position_offset=0.5",
    "model.dn_number=0",
    "loss.cls_loss_coef=2.0",
    "schedule.lr_drop=14",
]
RECIPE = TWO_STAGE + [
    "model.mixed_selection=true",
    "model.look_forward_twice=true",
    "model.num_queries_one2many=150",
    "loss.k_one2many=6",
    "loss.lambda_one2many=1.0",
]


def train(name: str, overrides: list, epochs: int, out_dir: Path, reuse: bool = False) -> list[dict]:
    """One run from scratch (with `reuse`, a finished run of the same command is read again instead) -> per
    evaluated epoch {epoch, seconds (cumulative training), steps (cumulative), AP, AP50, AP75}."""
    run_dir = out_dir / name.replace(" ", "_").replace(",", "").replace("'", "")
    command = [sys.executable, "train.py", "--config", "shapes", "--output-dir", str(run_dir), "--overwrite"]
    command += [f"schedule.epochs={epochs}", *overrides]
    done = run_dir / "command.txt"
    if not (reuse and done.is_file() and done.read_text() == " ".join(command[1:])):
        print(" ".join(command), flush=True)
        started = time.perf_counter()
        subprocess.run(command, cwd=ROOT, check=True)
        print(f"{name}: {time.perf_counter() - started:.0f} s in all", flush=True)
        done.write_text(" ".join(command[1:]))
    seconds, steps, rows = 0.0, 0, []
    for line in (run_dir / "log.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "epoch_steps" in record:
            seconds, steps = seconds + record["seconds"], steps + record["epoch_steps"]
        elif "eval" in record:
            stats = record["eval"]
            aps = {k: stats[k] for k in ("AP", "AP50", "AP75")}
            rows.append({"epoch": record["epoch"] + 1, "seconds": seconds, "steps": steps, **aps})
    return rows


def table(title: str, base: list[dict], recipe: list[dict], names=("quick start", "recipe")) -> list[str]:
    """The lines of a comparison: `title`, the CPU, then per epoch both runs' training seconds, AP, AP50, AP75."""
    first, second = (f"{name}: s" for name in names)
    lines = [
        title,
        f"CPU: {cpu_model()}; load average before: {load_average()}; {time.strftime('%Y-%m-%d')}; one run each",
        "",
        f"{'epoch':>5} | {first:>14} {'AP':>6} {'AP50':>6} {'AP75':>6} | {second:>9} {'AP':>6} {'AP50':>6} {'AP75':>6}",
    ]
    for a, b in zip(base, recipe, strict=False):
        lines.append(
            f"{a['epoch']:>5} | {a['seconds']:>{max(len(first), 14)}.0f} {a['AP']:>6.3f} "
            f"{a['AP50']:>6.3f} {a['AP75']:>6.3f} | {b['seconds']:>{max(len(second), 9)}.0f} {b['AP']:>6.3f} "
            f"{b['AP50']:>6.3f} {b['AP75']:>6.3f}"
        )
    return lines


def at_seconds(rows: list[dict], seconds: float) -> dict:
    """The last evaluation reached within `seconds` of training."""
    reached = [row for row in rows if row["seconds"] <= seconds * 1.001]
    return reached[-1] if reached else {"epoch": 0, "seconds": 0.0, "AP": 0.0, "AP50": 0.0, "AP75": 0.0}


def picture(curves: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2))
    for name, rows in curves.items():
        axes.plot([r["seconds"] / 60 for r in rows], [r["AP"] for r in rows], marker="o", markersize=3, label=name)
    axes.set_xlabel("training time (min, steps only)")
    axes.set_ylabel("val AP")
    axes.set_title("the quick start's set: today's recipe and H-Deformable-DETR's")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main():
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=18, help="the quick start's 18")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "hybrid_quickstart_cpu.txt")
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "output" / "bench_hybrid")
    parser.add_argument("--short-epochs", type=int, default=13)
    parser.add_argument("--short-lr-drop", type=int, default=10)
    parser.add_argument("--long-epochs", type=int, default=25)
    parser.add_argument("--long-lr-drop", type=int, default=19)
    parser.add_argument("--reuse", action="store_true", help="read finished runs of the same commands again")
    args = parser.parse_args()
    short = RECIPE + [f"schedule.lr_drop={args.short_lr_drop}"]
    runs = {
        "quick start": (TWO_STAGE, args.epochs),
        "recipe": (RECIPE, args.epochs),
        "recipe, the quick start's time": (short, args.short_epochs),
        "quick start, the recipe's time": (TWO_STAGE + [f"schedule.lr_drop={args.long_lr_drop}"], args.long_epochs),
    }
    curves = {name: train(name, o, epochs, args.runs_dir, args.reuse) for name, (o, epochs) in runs.items()}
    base, recipe, short_run = curves["quick start"], curves["recipe"], curves["recipe, the quick start's time"]
    long_run = curves["quick start, the recipe's time"]
    lines = table(__doc__.split("\n\n")[0], base, recipe)
    same_time = at_seconds(recipe, base[-1]["seconds"])
    lines += [
        "",
        f"equal epochs ({args.epochs}): quick start AP {base[-1]['AP']:.3f} AP50 {base[-1]['AP50']:.3f} AP75 "
        f"{base[-1]['AP75']:.3f}; recipe AP {recipe[-1]['AP']:.3f} AP50 {recipe[-1]['AP50']:.3f} AP75 "
        f"{recipe[-1]['AP75']:.3f}",
        f"equal time (the quick start's {base[-1]['seconds']:.0f} s of steps): the 18-epoch recipe at epoch "
        f"{same_time['epoch']}, AP {same_time['AP']:.3f} AP50 {same_time['AP50']:.3f} AP75 {same_time['AP75']:.3f}; "
        f"the recipe's {args.short_epochs}-epoch schedule ({short_run[-1]['seconds']:.0f} s): "
        f"AP {short_run[-1]['AP']:.3f} AP50 {short_run[-1]['AP50']:.3f} AP75 {short_run[-1]['AP75']:.3f}",
        f"equal time (the recipe's {recipe[-1]['seconds']:.0f} s): the quick start's {args.long_epochs}-epoch schedule "
        f"({long_run[-1]['seconds']:.0f} s): AP {long_run[-1]['AP']:.3f} AP50 {long_run[-1]['AP50']:.3f} AP75 "
        f"{long_run[-1]['AP75']:.3f}",
        f"a recipe step costs {recipe[-1]['seconds'] / base[-1]['seconds']:.2f}x a quick start step",
    ]
    report(lines, args.output)
    picture(curves, args.output.with_suffix(".png"))


if __name__ == "__main__":
    main()
