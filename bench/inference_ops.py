"""R50 inference with this project's one-pass CPU operations against MLX's own ops in their place,
alternating in one process: `kernels.channel_affine` (the backbone's frozen batch norm with its
residual and ReLU), `kernels.linear` (nn.Linear's bias rows written on every core),
`kernels.sin_cos` (the position encoding's sines and cosines) and `kernels.relu` (the FFNs'); and the
sampling locations of `MSDeformAttn` on rows of levels x points x 2 against the broadcasts in their
natural shapes, and the position encoding of the four levels with and without `kernels.sin_cos`, at the encoder's shape.

    python bench/inference_ops.py [--size 800x1066] [--repeats 5] [--output bench/results/inference_ops_cpu.txt]

configs/r50.yaml's model on a seeded random image (bench/model.py's setup). The outputs of the two
sides are compared bit for bit.
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
from deformable_detr.models import linear, position_encoding, precision, recompute  # noqa: E402
from kernels.channel_affine import with_mlx_ops as channel_affine_with_mlx_ops  # noqa: E402
from kernels.sin_cos import with_mlx_ops as sin_cos_with_mlx_ops  # noqa: E402

import mlx.core as mx  # noqa: E402
from common import bench_parser, median_time, sides_report  # noqa: E402
from model import ours_setup  # noqa: E402


def mlx_linear(x, weight, bias=None):
    """nn.Linear's own call."""
    return x @ weight.T if bias is None else mx.addmm(bias, x, weight.T)


def use(namespace):
    """The modules that call these operations take them from `namespace`."""
    precision.kernels = linear.kernels = position_encoding.kernels = recompute.kernels = namespace


def inference_times(size, repeats) -> tuple[dict, bool]:
    """side -> R50 inference seconds, the sides alternating; and whether their outputs agree bit for bit."""
    names = {name: getattr(kernels, name) for name in kernels.__all__}
    sides = {
        "ours": types.SimpleNamespace(**names),
        "MLX's ops": types.SimpleNamespace(
            **{
                **names,
                "channel_affine": channel_affine_with_mlx_ops,
                "linear": mlx_linear,
                "sin_cos": sin_cos_with_mlx_ops,
                "relu": lambda x: mx.maximum(x, 0),
            }
        ),
    }
    _, model, _, images, mask, _ = ours_setup("inference", size)
    x, m = mx.array(images), mx.array(mask)
    times, outputs = {side: [] for side in sides}, {}
    for round_ in range(repeats + 1):  # the first round warms up
        for side, namespace in sides.items():
            use(namespace)
            start = time.perf_counter()
            outputs[side] = model(x, m)
            mx.eval(outputs[side])
            if round_:
                times[side].append(time.perf_counter() - start)
    use(kernels)
    same = all(
        mx.array_equal(outputs["ours"][k], outputs["MLX's ops"][k]).item() for k in ("pred_logits", "pred_boxes")
    )
    return times, same


def locations_times(repeats: int = 10) -> tuple[float, float, bool]:
    """The encoder's sampling locations at 800 x 1066 (batch 1, 17,821 queries), both forms."""
    shapes = ((100, 134), (50, 67), (25, 34), (13, 17))
    b, q, heads, levels, points = 1, sum(h * w for h, w in shapes), 8, 4, 4
    offsets = mx.random.normal((b, q, heads, levels, points, 2), key=mx.random.key(0))
    reference = mx.random.uniform(shape=(b, q, levels, 2), key=mx.random.key(1))
    normalizer = mx.array([[w, h] for h, w in shapes], dtype=mx.float32)
    mx.eval(offsets, reference)

    def natural():
        return reference[:, :, None, :, None, :] + offsets / normalizer[:, None, :]

    def rows():  # as MSDeformAttn computes them
        divisor = mx.broadcast_to(normalizer[:, None, :], (levels, points, 2)).reshape(-1)
        centres = mx.broadcast_to(reference[:, :, :, None, :], (b, q, levels, points, 2)).reshape(b, q, 1, -1)
        return (centres + offsets.reshape(b, q, heads, -1) / divisor).reshape(offsets.shape)

    first = median_time(lambda: mx.eval(natural()), repeats)
    second = median_time(lambda: mx.eval(rows()), repeats)
    return first, second, mx.array_equal(natural(), rows()).item()


def position_encoding_times(repeats: int = 10) -> tuple[float, float, bool]:
    """PositionEmbeddingSine of the four levels at 800 x 1066, with MLX's sin and cos and with sin_cos."""
    encoding = position_encoding.PositionEmbeddingSine(128)
    masks = [mx.zeros((1, h, w), dtype=mx.bool_) for h, w in ((100, 134), (50, 67), (25, 34), (13, 17))]
    results, seconds = {}, {}
    for side, namespace in (("mlx", types.SimpleNamespace(sin_cos=sin_cos_with_mlx_ops)), ("ours", kernels)):
        use(namespace)
        seconds[side] = median_time(lambda: mx.eval([encoding(m) for m in masks]), repeats)
        results[side] = [encoding(m) for m in masks]
    use(kernels)
    same = all(mx.array_equal(a, b).item() for a, b in zip(results["mlx"], results["ours"], strict=True))
    return seconds["mlx"], seconds["ours"], same


@entry_point
def main(argv=None):
    rounds = "timed rounds (each runs both sides)"
    args = bench_parser(__doc__, "800x1066", "inference_ops_cpu.txt", 5, "the image", rounds).parse_args(argv)
    locations = "MSDeformAttn's sampling locations, encoder at 800x1066 (1 x 17,821 x 8 x 4 x 4 x 2), median of 10:"
    sines = "PositionEmbeddingSine of the four levels at 800x1066 (4.56 M sines and cosines), median of 10:"
    pairs = [
        (locations, ("- broadcasts in their natural shapes:", "on rows of levels x points x 2:"), locations_times),
        (sines, ("- mx.sin and mx.cos:", "kernels.sin_cos:"), position_encoding_times),
    ]
    sides_report(args, inference_times, "R50 inference, batch 1", "outputs", pairs)


if __name__ == "__main__":
    main()
