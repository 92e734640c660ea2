"""An R50 training step with `kernels.masked_scale` and `kernels.scale_where_positive` (dropout, dropout
after a ReLU, and the ReLUs' gradients, in one pass on every core) against MLX's where, maximum and
multiply in their place (one thread and one pass each), alternating in one process.

    python bench/step_ops.py [--size 512x683] [--repeats 3] [--output bench/results/step_ops_cpu.txt]

configs/r50.yaml's training step at micro-batch 2 on seeded random images (bench/model.py's setup),
dropout on. The two sides' losses and gradients are compared bit for bit. Then the operations alone at
an encoder FFN's shape at 512 x 683 (2 x 7,320 x 1,024): dropout after the ReLU and its gradient, both
ways, outputs compared.
"""

import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import deformable_detr  # noqa: E402, F401  (first: it loads the BLAS MLX then calls, and sets glibc's malloc)
import kernels  # noqa: E402
from deformable_detr.errors import entry_point  # noqa: E402
from deformable_detr.models import recompute  # noqa: E402
from deformable_detr.training.trainer import seed_step  # noqa: E402
from kernels.masked_scale import masked_scale_with_mlx_ops, scale_where_positive_with_mlx_ops  # noqa: E402

import mlx.core as mx  # noqa: E402
from common import bench_parser, median_time, sides_report  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from model import ours_setup  # noqa: E402


def step_times(size, repeats) -> tuple[dict, bool]:
    """side -> step seconds, the sides alternating; and whether their losses and gradients agree bit for bit."""
    names = {name: getattr(kernels, name) for name in kernels.__all__}
    mlx_ops = {"masked_scale": masked_scale_with_mlx_ops, "scale_where_positive": scale_where_positive_with_mlx_ops}
    sides = {"ours": kernels, "MLX's ops": types.SimpleNamespace(**{**names, **mlx_ops})}
    cfg, _, trainer, images, mask, targets = ours_setup("train", size)
    x, m, boxes = mx.array(images), mx.array(mask), trainer.num_boxes(targets)
    times, results = {side: [] for side in sides}, {}
    for round_ in range(repeats + 1):  # the first round warms up
        for side, namespace in sides.items():
            recompute.kernels = namespace
            seed_step(cfg.seed, 0)  # the same dropout masks on both sides
            start = time.perf_counter()
            (total, _), grads = trainer.loss_and_grad(x, m, targets, boxes)
            mx.eval(total, grads)
            if round_:
                times[side].append(time.perf_counter() - start)
            results[side] = [total] + [g for _, g in tree_flatten(grads)]
    recompute.kernels = kernels
    ours, theirs = results["ours"], results["MLX's ops"]
    same = len(ours) == len(theirs) and all(mx.array_equal(a, b).item() for a, b in zip(ours, theirs, strict=True))
    return times, same


def ffn_times(repeats: int = 10) -> tuple[float, float, bool]:
    """Dropout after the FFN's ReLU, forward and gradient, on (2 x 7320, 1024): MLX's ops, then ours; each
    less the x + 0 and g + 0 copies that give it buffers to take over (as in the step), timed alone."""
    shape, scale = (2 * 7320, 1024), 65536 / 58982
    x, g = mx.random.normal(shape, key=mx.random.key(0)), mx.random.normal(shape, key=mx.random.key(1))
    keep = mx.random.uniform(shape=shape, key=mx.random.key(2)) < 0.9
    mx.eval(x, g, keep)
    results, seconds = {}, {}
    for side, ops in (
        ("mlx", (masked_scale_with_mlx_ops, scale_where_positive_with_mlx_ops)),
        ("ours", (kernels.masked_scale, kernels.scale_where_positive)),
    ):

        def run(masked=ops[0], positive=ops[1]):
            out = masked(x + 0, keep, scale, relu=True)  # x + 0: a buffer the op may take over, as in the step
            return out, positive(g + 0, out, scale)

        seconds[side] = median_time(lambda run=run: mx.eval(run()), repeats)
        results[side] = run()
    seconds["copies"] = median_time(lambda: mx.eval(x + 0, g + 0), repeats)
    same = all(mx.array_equal(a, b).item() for a, b in zip(results["mlx"], results["ours"], strict=True))
    return seconds["mlx"] - seconds["copies"], seconds["ours"] - seconds["copies"], same


@entry_point
def main(argv=None):
    rounds = "timed rounds (each runs both sides)"
    args = bench_parser(__doc__, "512x683", "step_ops_cpu.txt", 3, repeats_help=rounds).parse_args(argv)
    dropout = "Dropout after an encoder FFN's ReLU at 512x683, (2 x 7320, 1024), forward and gradient, median of 10"
    pairs = [(dropout, ("(less the input copies): MLX's ops", "ours"), ffn_times)]
    sides_report(args, step_times, "R50 training step, micro-batch 2", "loss and gradients", pairs)


if __name__ == "__main__":
    main()
