"""DINO's recipe against the authors' two-stage model (the quick start until 2026-12-07), on the quick start's own
set: AP after each epoch and the training seconds spent to reach it, so both compare in equal epochs and in equal
wall time.

    python bench/dino_quickstart.py [--epochs 18] [--dn-numbers 20 8 0] [--output bench/results/dino_quickstart_cpu.txt]

Runs of `train.py --config shapes`, differing only in the recipe's keys, each set on the command line (so the
runs do not depend on what configs/shapes.yaml holds: DINO's recipe since 2026-12-07). Both have dropout 0, two-stage
and box refinement, FFN 256, 2 + 3 layers and 30 queries, so the gain is the recipe's, not a bigger model's:
  two-stage:   the authors' two-stage model (hybrid_quickstart.TWO_STAGE: their position encoding, focal loss
               weight 2)
  DINO N:      model.architecture=dino (shared heads, ref_point_head, proposals by their best class score),
               model.mixed_selection=true, model.look_forward_twice=true, DINO's position encoding (temperature
               20, no half-pixel offset), model.dn_number=N (2 N denoising queries a step; N=0 none),
               loss.cls_loss_coef=1.0 (DINO's)
  DINO N, the two-stage model's time: the first N's recipe, its schedule shortened to the two-stage model's time
  two-stage, DINO's time: the two-stage schedule lengthened to the first N's 18 epochs' time
  ..., seed S: the two-stage model and the first N again, 18 epochs, in each of --other-seeds (1; the config's is 42)
Time is counted two ways. "Step cost": each run's steps times a step's cost measured first, the configs' steps
alternating in one process (synthetic batches of 8 at 128 x 128 with 1 to 4 boxes an image, as the set's; saved in
the runs' folder and read again with --reuse), which other processes on the machine load alike; this sets the
shortened and lengthened schedules (the lr drop at the two-stage schedule's share, 14 of 18; --short-epochs and
--long-epochs set them instead) and the equal-time comparison. "Log": the training steps' seconds of each run's
log.jsonl (not the evaluations'), which carry whatever else ran at the time. Writes the table and a picture of the
val curves (AP against training time, both ways) beside the output.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_features, cpu_model, load_average, report  # noqa: E402
from hybrid_quickstart import ROOT, TWO_STAGE, at_seconds, train  # noqa: E402

RECIPE = [
    "model.architecture=dino",
    "model.mixed_selection=true",
    "model.look_forward_twice=true",
    "model.position_temperature=20",
    "model.position_offset=0.0",
    "loss.cls_loss_coef=1.0",
]
LR_DROP_SHARE = 14 / 18  # the two-stage quick start's lr drop in its 18 epochs


def recipe(dn_number: int) -> list[str]:
    return RECIPE + [f"model.dn_number={dn_number}"]


def step_costs(recipes: dict, rounds: int, steps: int) -> dict:
    """name -> the median seconds of a training step of `train.py --config shapes` with the recipe's overrides,
    the names' steps alternating (`rounds` rounds of `steps` steps each, after 2 warm-up steps each) in this
    process; a batch of 8 synthetic 128 x 128 images with 1, 2, 3, 4, 2, 3, 4 and 1 boxes (the set has 1 to 4)."""
    import kernels  # noqa: F401  (before mlx: the BLAS)
    from deformable_detr import build_model, load_config
    from deformable_detr.training.trainer import Trainer

    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(0)
    images = rng.standard_normal((8, 128, 128, 3)).astype(np.float32)
    mask = np.zeros((8, 128, 128), bool)
    targets = []
    for count in (1, 2, 3, 4, 2, 3, 4, 1):
        centres = rng.uniform(0.2, 0.8, (count, 2))
        sizes = rng.uniform(0.1, 0.3, (count, 2))
        boxes = np.concatenate([centres, sizes], axis=1).astype(np.float32)
        targets.append({"labels": rng.integers(1, 6, count), "boxes": boxes})
    trainers = {}
    for name, overrides in recipes.items():
        cfg = load_config("shapes", overrides + ["train.check_sampling_offsets=false"])
        mx.random.seed(0)
        trainers[name] = Trainer.from_config(build_model(cfg), cfg, [(128, 128)])
        for i in range(2):
            trainers[name].step([(images, mask, targets)], i)
    seconds = {name: [] for name in recipes}
    for _ in range(rounds):
        for name, trainer in trainers.items():
            for i in range(steps):
                started = time.perf_counter()
                trainer.step([(images, mask, targets)], i)
                seconds[name].append(time.perf_counter() - started)
    return {name: statistics.median(times) for name, times in seconds.items()}


def ap_line(row: dict) -> str:
    return f"AP {row['AP']:.3f} AP50 {row['AP50']:.3f} AP75 {row['AP75']:.3f}"


def measured_costs(recipes: dict, rounds: int, path: Path, reuse: bool) -> dict:
    """step_costs, saved to `path` with the load average around them; with `reuse`, read from it when it holds
    the same recipes."""
    if reuse and path.is_file():
        saved = json.loads(path.read_text())
        if saved["recipes"] == recipes:
            return saved
    before = load_average()
    costs = step_costs(recipes, rounds, 5)
    saved = {"recipes": recipes, "seconds": costs, "load": f"{before} before, {load_average()} after"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved, indent=1))
    return saved


def picture(curves: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for axes, key, label in (
        (panels[0], "cost_seconds", "training time by the alternating step cost (min)"),
        (panels[1], "seconds", "training time by the runs' logs (min; other processes' load in it)"),
    ):
        for name, rows in curves.items():
            style = {"linestyle": "--", "linewidth": 1} if "seed" in name else {}
            axes.plot(
                [r[key] / 60 for r in rows], [r["AP"] for r in rows], marker="o", markersize=3, label=name, **style
            )
        axes.set_xlabel(label, fontsize=9)
        axes.grid(alpha=0.3)
    panels[0].set_ylabel("val AP")
    panels[0].legend(fontsize=8)
    figure.suptitle("the quick start's set: the authors' two-stage recipe and DINO's (same model size)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=18, help="the two-stage quick start's 18")
    parser.add_argument(
        "--dn-numbers",
        type=int,
        nargs="+",
        default=[20, 8, 0],
        help="2 N denoising queries; the first also in equal time",
    )
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "dino_quickstart_cpu.txt")
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "output" / "bench_dino")
    parser.add_argument("--short-epochs", type=int, default=0, help="0: from the measured step cost")
    parser.add_argument("--long-epochs", type=int, default=0, help="0: from the measured step cost")
    parser.add_argument("--cost-rounds", type=int, default=5)
    parser.add_argument("--other-seeds", type=int, nargs="*", default=[1], help="the two-stage model and DINO again")
    parser.add_argument("--reuse", action="store_true", help="read finished runs and the step costs again")
    args = parser.parse_args()
    first, quick, dino_name = args.dn_numbers[0], "two-stage", f"DINO N={args.dn_numbers[0]}"
    recipes = {quick: TWO_STAGE, **{f"DINO N={n}": recipe(n) for n in args.dn_numbers}}
    saved = measured_costs(recipes, args.cost_rounds, args.runs_dir / "step_costs.json", args.reuse)
    costs = saved["seconds"]
    ratio = costs[dino_name] / costs[quick]
    short_epochs = args.short_epochs or round(args.epochs / ratio)
    long_epochs = args.long_epochs or round(args.epochs * ratio)

    def schedule(epochs: int) -> list[str]:
        return [f"schedule.lr_drop={round(epochs * LR_DROP_SHARE)}"]

    short_name, long_name = f"{dino_name}, the two-stage model's time", "two-stage, DINO's time"
    runs = {  # name -> (overrides, epochs, whose step cost)
        quick: (TWO_STAGE + schedule(args.epochs), args.epochs, quick),
        **{f"DINO N={n}": (recipe(n) + schedule(args.epochs), args.epochs, f"DINO N={n}") for n in args.dn_numbers},
        short_name: (recipe(first) + schedule(short_epochs), short_epochs, dino_name),
        long_name: (TWO_STAGE + schedule(long_epochs), long_epochs, quick),
        **{
            f"two-stage, seed {seed}": (TWO_STAGE + schedule(args.epochs) + [f"seed={seed}"], args.epochs, quick)
            for seed in args.other_seeds
        },
        **{
            f"{dino_name}, seed {seed}": (
                recipe(first) + schedule(args.epochs) + [f"seed={seed}"],
                args.epochs,
                dino_name,
            )
            for seed in args.other_seeds
        },
    }
    curves, loads = {}, [f"the step costs: {saved['load']}"]
    for name, (overrides, epochs, cost) in runs.items():
        loads.append(f"before {name}: {load_average()}")
        curves[name] = [
            {**row, "cost_seconds": row["steps"] * costs[cost]}
            for row in train(name, overrides, epochs, args.runs_dir, args.reuse)
        ]
    base, dino = curves[quick], curves[dino_name]
    short_run, long_run = curves[short_name], curves[long_name]
    lines = [
        __doc__.split("\n\n")[0],
        f"CPU: {cpu_model(count=True)} ({cpu_features()}); {time.strftime('%Y-%m-%d')}; one training run each",
        "",
        "a step (alternating in one process, batch 8 at 128 x 128, median): "
        + ", ".join(f"{name} {s * 1e3:.0f} ms ({s / costs[quick]:.2f}x)" for name, s in costs.items()),
        "",
        f"{'':>5} | {'two-stage (the earlier quick start)':^34} | "
        f"{dino_name + ' (' + str(2 * first) + ' denoising queries)':^34}",
        f"{'epoch':>5} | {'cost s':>6} {'log s':>6} {'AP':>6} {'AP50':>6} {'AP75':>6} | {'cost s':>6} {'log s':>6} "
        f"{'AP':>6} {'AP50':>6} {'AP75':>6}",
    ]
    for a, b in zip(base, dino, strict=False):
        lines.append(
            f"{a['epoch']:>5} | {a['cost_seconds']:>6.0f} {a['seconds']:>6.0f} {a['AP']:>6.3f} {a['AP50']:>6.3f} "
            f"{a['AP75']:>6.3f} | {b['cost_seconds']:>6.0f} {b['seconds']:>6.0f} {b['AP']:>6.3f} {b['AP50']:>6.3f} "
            f"{b['AP75']:>6.3f}"
        )
    spent = base[-1]["cost_seconds"]
    lines += ["", f"equal epochs ({args.epochs}): two-stage {ap_line(base[-1])}"]
    for n in args.dn_numbers:
        end = curves[f"DINO N={n}"][-1]
        lines.append(
            f"  DINO N={n} ({f'{2 * n} denoising queries' if n else 'no denoising'}): {ap_line(end)} "
            f"(step cost {end['cost_seconds'] / spent:.2f}x)"
        )
    lines += [
        f"equal time (the two-stage model's 18 epochs, {spent:.0f} s by step cost):",
        f"  {dino_name}'s {short_epochs}-epoch schedule (lr drop at {round(short_epochs * LR_DROP_SHARE)}; "
        f"{short_run[-1]['cost_seconds']:.0f} s): {ap_line(short_run[-1])}",
    ]
    for n in args.dn_numbers:
        reached = at_seconds([{**r, "seconds": r["cost_seconds"]} for r in curves[f"DINO N={n}"]], spent)
        dropped = "after" if reached["epoch"] > 14 else "before"  # the two-stage lr drop: from the 15th epoch
        lines.append(
            f"  the 18-epoch DINO N={n} at epoch {reached['epoch']} ({dropped} its lr drop): {ap_line(reached)}"
        )
    lines += [
        f"equal time ({dino_name}'s 18 epochs, {dino[-1]['cost_seconds']:.0f} s by step cost): the two-stage model's "
        f"{long_epochs}-epoch schedule (lr drop at {round(long_epochs * LR_DROP_SHARE)}; "
        f"{long_run[-1]['cost_seconds']:.0f} s): {ap_line(long_run[-1])}",
    ]
    for seed in args.other_seeds:
        other_base, other_dino = curves[f"two-stage, seed {seed}"], curves[f"{dino_name}, seed {seed}"]
        reached = at_seconds([{**r, "seconds": r["cost_seconds"]} for r in other_dino], other_base[-1]["cost_seconds"])
        lines.append(
            f"another seed ({seed}; the runs above: 42), 18 epochs: two-stage {ap_line(other_base[-1])}; {dino_name} "
            f"{ap_line(other_dino[-1])}, at the two-stage model's time (epoch {reached['epoch']}) {ap_line(reached)}"
        )
    lines += [
        "",
        "how quiet (load averages, 1/5/15 min; 2 cores shared with other sessions' tests, so the logs' seconds carry "
        "their load and the step costs, alternating, decide the equal-time comparison): " + "; ".join(loads),
        f"after the last run: {load_average()}",
    ]
    report(lines, args.output)
    picture(curves, args.output.with_suffix(".png"))


if __name__ == "__main__":
    main()
