"""Which way each backward pass of an R50 training step runs fastest here: oneDNN's kernel or the patches
(im2col / col2im on every core and the BLAS's products, models/convolution.py), for every
trainable convolution's backward data and backward weights; oneDNN's product against the BLAS's
(MLX's matmul) for the linears' weight gradients; and for their other products (x W^T, and g W for the
input's gradient) oneDNN's matmul against its 1 x 1 convolution and the BLAS. What
kernels/native/onednn_conv.cpp's and onednn_product.cpp's rules (`slower_than_patches`, `gradient_product`,
`plan_convolution`) were read from, and what shows they still hold.

    python bench/conv_backward.py [--size 512x683] [--repeats 5] [--output bench/results/conv_backward_cpu.txt]

Each row: the R50 backbone's convolution at batch 2 (stages 2-4; the stem and stage 1 are frozen), how many
the step has, the forward and each pass's time with oneDNN's kernel and with the patches (median of
`--repeats` after a warm-up, in milliseconds, the forward included in each pass's time), and which the
plan now picks. It runs with KERNELS_ONEDNN_SLOWER_PASSES=1 so that oneDNN's own kernels can be
timed. Run it as the machine is, or as an AVX2 CPU (bench/cpu_tables.sh --as-avx2's variables).
"""

import os
import sys
import time
from pathlib import Path

os.environ["KERNELS_ONEDNN_SLOWER_PASSES"] = "1"  # read when kernels loads oneDNN, at its first call
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels  # noqa: E402, I001  (before mlx: the BLAS)

import mlx.core as mx  # noqa: E402
from common import bench_parser, cpu_model, instruction_caps, load_average, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def median_ms(run, repeats: int) -> float:
    mx.eval(run())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(run())
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1e3


def step_convolutions(size) -> dict:
    """{(x shape, weight shape, stride, padding): how many} of the R50 backbone's trainable stages."""
    from deformable_detr import build_model, load_config
    from deformable_detr.models import backbone

    model = build_model(load_config(ROOT / "configs" / "r50.yaml"))
    seen, call = {}, backbone.Conv2d.__call__

    def counting(conv, x):
        key = (tuple(x.shape), tuple(conv.weight.shape), conv.stride[0], conv.padding[0])
        seen[key] = seen.get(key, 0) + 1
        return call(conv, x)

    backbone.Conv2d.__call__ = counting
    try:
        model.eval()
        mx.eval(model(mx.zeros((2, *size, 3)), mx.zeros((2, *size), mx.bool_)))
    finally:
        backbone.Conv2d.__call__ = call
    # the stem and stage 1 (frozen in training) are the convolutions with 64 channels in or out
    return {key: n for key, n in seen.items() if 64 not in (key[1][0], key[1][3])}


def convolution_row(key, count, repeats) -> tuple[str, float, float]:
    from deformable_detr.models.backbone import Conv2d

    x_shape, w_shape, stride, padding = key
    x, w = mx.random.normal(x_shape), mx.random.normal(w_shape) * 0.01
    cotangent = mx.random.normal(mx.conv2d(x, w, stride, padding).shape)
    conv = Conv2d(w_shape[3], w_shape[0], w_shape[1], stride, padding, bias=False)
    onednn_conv = kernels.onednn.conv2d

    def patches(x, w):
        conv.weight = w
        kernels.onednn.conv2d = lambda *args, **kwargs: None
        try:
            return conv(x)
        finally:
            kernels.onednn.conv2d = onednn_conv

    ways = {"oneDNN": lambda x, w: onednn_conv(x, w, stride, padding), "patches": patches}
    times = {
        name: (
            median_ms(lambda f=f: f(x, w), repeats),
            median_ms(lambda f=f: mx.vjp(lambda x: f(x, w), [x], [cotangent])[1], repeats),
            median_ms(lambda f=f: mx.vjp(lambda w: f(x, w), [w], [cotangent])[1], repeats),
        )
        for name, f in ways.items()
    }
    # what the plan picks without the variable: its rule, not its timing
    kernels_used = kernels.onednn.module().conv2d_implementation(x, w, stride, padding, 1, False, True).split("; ")
    picks = [
        "patches" if kernel.startswith("patches") or _rule_refuses(kernel, w_shape, stride) else kernel
        for kernel in kernels_used[1:]
    ]
    (f1, d1, w1), (f2, d2, w2) = times["oneDNN"], times["patches"]
    row = (
        f"| {x_shape[1]}x{x_shape[2]}x{x_shape[3]} | {w_shape[0]}x{w_shape[1]}x{w_shape[2]}, stride {stride} | {count} "
        f"| {f1:.1f} / {f2:.1f} | {d1:.1f} / {d2:.1f} | {w1:.1f} / {w2:.1f} | {picks[0]} | {picks[1]} |"
    )
    best = count * (min(d1, d2) + min(w1, w2) - min(f1, f2))
    picked = count * ((d2 if picks[0] == "patches" else d1) + (w2 if picks[1] == "patches" else w1) - f1)
    return row, best, picked


def _rule_refuses(kernel: str, w_shape, stride) -> bool:
    """onednn_conv.cpp's slower_than_patches, for a float32 pass (the variable above keeps the plan from it)."""
    direct = kernel.startswith(("jit:", "jit_1x1:"))
    return direct and (kernel.endswith(":avx2") or (w_shape[1] == 1 and stride > 1))


def product_rows(size, repeats) -> list[str]:
    """The encoder's linears' weight gradients (x^T g, a long reduction over the tokens) at batch 2."""
    rows_count = 2 * sum(
        (size[0] // s + (size[0] % s > 0)) * (size[1] // s + (size[1] % s > 0)) for s in (8, 16, 32, 64)
    )
    extension = kernels.onednn.module()
    lines = []
    for inner, outer in ((256, 1024), (1024, 256), (256, 256), (256, 128)):
        x, g = mx.random.normal((rows_count, inner)), mx.random.normal((rows_count, outer))
        ours = median_ms(lambda g=g, x=x: extension.product(g, x, None, True, False, False, None, 2), repeats)
        blas = median_ms(lambda g=g, x=x: g.T @ x, repeats)
        lines.append(f"| {outer}x{rows_count} @ {rows_count}x{inner} | {ours:.1f} | {blas:.1f} |")
    return lines


def linear_rows(size, repeats) -> list[str]:
    """The encoder's linears' products (rows, k) x (k, n) at batch 2: oneDNN's matmul (the variable above
    keeps it from the 1 x 1 convolution), its 1 x 1 convolution of the same memory, the BLAS's; GFLOP/s."""
    rows_count = 2 * sum(
        (size[0] // s + (size[0] % s > 0)) * (size[1] // s + (size[1] % s > 0)) for s in (8, 16, 32, 64)
    )
    extension = kernels.onednn.module()
    lines = []
    for k, n in ((1024, 256), (256, 1024), (256, 256), (256, 128), (128, 256)):
        a, w = mx.random.normal((rows_count, k)), mx.random.normal((n, k)) * 0.05
        ways = {
            "matmul": lambda a=a, w=w: extension.product(a, w, None, False, True, False, None, 2),
            "conv": lambda a=a, w=w: extension.conv2d(a[None, None], w[:, None, None], 1, 0, 1, False, None, 2),
            "blas": lambda a=a, w=w: a @ w.T,
        }
        flop = 2 * rows_count * k * n / 1e6
        rates = {name: flop / median_ms(run, repeats) for name, run in ways.items()}
        matmul = extension.product_implementation(a, w, None, False, True)
        pick = "1 x 1 convolution" if matmul.startswith("gemm:jit") and k >= 4 * n else matmul
        lines.append(
            f"| {rows_count}x{k} @ {k}x{n} | {matmul} | {rates['matmul']:.0f} | {rates['conv']:.0f} "
            f"| {rates['blas']:.0f} | {pick} |"
        )
    return lines


def main(argv=None):
    parser = bench_parser(__doc__, "512x683", "conv_backward_cpu.txt", 5)
    args = parser.parse_args(argv)
    size = args.size[0]
    lines = [
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU: {cpu_model(count=True)}"
        f"{instruction_caps()}; load average at start: {load_average()}",
        f"{kernels.onednn.describe()}, BLAS {kernels.blas.description()}; R50 at batch 2, {size[0]}x{size[1]}; "
        f"median of {args.repeats}, ms; each pass's time includes the forward; oneDNN / patches",
        "",
        "| input | weight | in a step | forward | + data | + weights | data: the plan's | weights: the plan's |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    best = picked = 0.0
    for key, count in sorted(step_convolutions(size).items()):
        row, row_best, row_picked = convolution_row(key, count, args.repeats)
        lines.append(row)
        print(row, flush=True)
        best, picked = best + row_best, picked + row_picked
    lines += [
        "",
        f"the backward passes of a step as the plan picks them: {picked:.0f} ms; the faster of the two each time: "
        f"{best:.0f} ms",
        "",
        "The linears' weight gradients (x^T g): oneDNN's product against the BLAS's (MLX's matmul), ms:",
        "",
        "| product | oneDNN | BLAS |",
        "| --- | ---: | ---: |",
        *product_rows(size, args.repeats),
        "",
        "The linears' products and their inputs' gradients: oneDNN's matmul, its 1 x 1 convolution, the BLAS, GFLOP/s:",
        "",
        "| product | oneDNN's matmul | matmul | 1 x 1 convolution | BLAS | the plan's |",
        "| --- | --- | ---: | ---: | ---: | --- |",
        *linear_rows(size, args.repeats),
        "",
        f"load average at the end: {load_average()}",
    ]
    report(lines, args.output)


if __name__ == "__main__":
    main()
