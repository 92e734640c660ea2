"""Time `kernels.ms_deform_attn` against the authors' PyTorch core on the Deformable DETR encoder shape.

    python bench/attention.py [--repeats 5] [--threads 2] [--torch-device cpu] [--output FILE]

Forward and forward+backward, median wall time of `--repeats` runs after one warm-up, for every
backend of `kernels` that runs on this machine (`kernels.available_backends()`: the MLX-ops path,
and the fused Metal or CUDA kernels where MLX has that back-end) and for the authors'
`ms_deform_attn_core_pytorch` (`F.grid_sample` per level) with `--threads` torch threads, or on
CUDA with `--torch-device cuda`; there, also the authors' compiled CUDA op when its extension
(`MultiScaleDeformableAttention`, built from their repository, not by this one) is importable.
`kernels` runs on MLX's default device. The ratio column is torch core / ours: above 1 means ours
is faster. The process keeps freed memory in glibc's heap, as every process that imports
deformable_detr does (`runtime.py`): both sides' fresh buffers are then reused, not page-faulted in
anew. On glibc's defaults (before 2026-12-02) the torch core's forward + backward took about 1.8x as
long here, ours 1.15x.
"""

import os
import platform
import sys
import time
from pathlib import Path

import kernels
from deformable_detr.errors import ArgumentParser, entry_point

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bars, cpu_model, instruction_caps, median_time  # noqa: E402
from torch_reference import ms_deform_attn_core  # noqa: E402  (the authors' core, shared with the tests)

ENCODER = dict(batch=2, shapes=((100, 134), (50, 67), (25, 34), (13, 17)), heads=8, channels=32, points=4)
FOLD = 4  # "l1" points: 5 x 5 rows a level, 4 levels, value and its gradient: 25.6 KB at 32 channels


def inputs(batch, shapes, heads, channels, points, seed=0, where="uniform"):
    """`where`: "uniform" points anywhere on each level, or "encoder" points as the encoder's: around
    each token's own position (its pixel centre, seen from every level), 2 pixels of the level apart;
    "l1": the encoder points folded into the first 4 x 4 pixels of each level (a diagnostic for
    bench/limits.py: the same bilinear weights and arithmetic, every tap row in L1)."""
    rng = np.random.default_rng(seed)
    length = sum(h * w for h, w in shapes)
    queries = length  # the encoder: every token queries
    value = rng.standard_normal((batch, length, heads, channels), dtype=np.float32)
    if where == "uniform":
        locations = rng.uniform(0, 1, (batch, queries, heads, len(shapes), points, 2)).astype(np.float32)
    else:
        centres = np.concatenate(
            [
                np.stack(np.meshgrid((np.arange(w) + 0.5) / w, (np.arange(h) + 0.5) / h), -1).reshape(-1, 2)
                for h, w in shapes
            ]
        )  # (L, 2) x, y
        sides = np.array([[w, h] for h, w in shapes], np.float64)  # (levels, 2)
        offsets = rng.normal(0, 2, (batch, queries, heads, len(shapes), points, 2)) / sides[:, None, :]
        locations = np.clip(centres[None, :, None, None, None, :] + offsets, 0, 1)
        if where == "l1":  # pixels modulo 4: each point keeps its place within its pixel
            locations = np.mod(locations * sides[:, None, :], FOLD) / sides[:, None, :]
        locations = locations.astype(np.float32)
    weights = rng.uniform(0, 1, (batch, queries, heads, len(shapes), points)).astype(np.float32)
    return value, locations, weights


def time_kernels(backend, shapes, arrays, repeats):
    value, locations, weights = (mx.array(a) for a in arrays)
    cotangent = mx.ones((value.shape[0], locations.shape[1], value.shape[2] * value.shape[3]))

    def forward():
        mx.eval(kernels.ms_deform_attn(value, shapes, None, locations, weights, backend=backend))

    def loss(v, locs, w):
        return (kernels.ms_deform_attn(v, shapes, None, locs, w, backend=backend) * cotangent).sum()

    # value_and_grad, not grad: the gradients do not need the output, and MLX would skip the forward.
    loss_and_grad = mx.value_and_grad(loss, argnums=(0, 1, 2))

    def forward_backward():
        mx.eval(loss_and_grad(value, locations, weights))

    return median_time(forward, repeats), median_time(forward_backward, repeats)


def time_torch(shapes, arrays, repeats, threads, device):
    import torch

    torch.set_num_threads(threads)
    value, locations, weights = (torch.tensor(a, device=device) for a in arrays)
    synchronize = torch.cuda.synchronize if device == "cuda" else lambda: None

    def forward():
        with torch.no_grad():
            ms_deform_attn_core(value, shapes, locations, weights)
        synchronize()

    def forward_backward():
        tensors = [t.clone().requires_grad_() for t in (value, locations, weights)]
        ms_deform_attn_core(tensors[0], shapes, tensors[1], tensors[2]).sum().backward()
        synchronize()

    return median_time(forward, repeats), median_time(forward_backward, repeats), torch.__version__


def time_authors_cuda_op(shapes, arrays, repeats):
    """The authors' compiled op, or None where its extension is not importable."""
    try:
        import MultiScaleDeformableAttention as extension
        import torch
    except ImportError:
        return None
    value, locations, weights = (torch.tensor(a, device="cuda") for a in arrays)
    spatial_shapes = torch.tensor(shapes, dtype=torch.long, device="cuda")
    starts = torch.cat([spatial_shapes.new_zeros(1), spatial_shapes.prod(1).cumsum(0)[:-1]])
    step = 64  # the authors' im2col_step

    def forward():
        out = extension.ms_deform_attn_forward(value, spatial_shapes, starts, locations, weights, step)
        torch.cuda.synchronize()
        return out

    def forward_backward():
        out = forward()
        extension.ms_deform_attn_backward(value, spatial_shapes, starts, locations, weights, torch.ones_like(out), step)
        torch.cuda.synchronize()

    return median_time(forward, repeats), median_time(forward_backward, repeats)


@entry_point
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--torch-device", choices=["cpu", "cuda"], default="cpu", help="where the torch core runs")
    parser.add_argument("--output", type=Path, help="also write the table to this file, and a chart beside it (.png)")
    parser.add_argument(
        "--points", choices=["uniform", "encoder"], default="uniform", help="uniform, or near each token (encoder-like)"
    )
    args = parser.parse_args(argv)

    shapes = ENCODER["shapes"]
    arrays = inputs(**ENCODER, where=args.points)
    b, q, h, levels, p, _ = arrays[1].shape
    lines = [
        f"ms_deform_attn, encoder shape: B={b}, Q=L={q}, levels {list(shapes)}, "
        f"{h} heads x {ENCODER['channels']} channels, {p} points ({args.points}), float32",
        f"machine: {platform.machine()}, {platform.system()}, python {platform.python_version()}, "
        f"mlx {mx.__version__} ({mx.default_device()}); glibc malloc: freed memory kept, both sides (as our "
        f"commands run); CPU: {cpu_model(count=True)}{instruction_caps()}, load average {os.getloadavg()[0]:.2f} "
        f"at the start, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
    ]
    torch_fwd, torch_both, torch_version = time_torch(shapes, arrays, args.repeats, args.threads, args.torch_device)
    where = f"{args.threads} threads" if args.torch_device == "cpu" else "cuda"
    lines.append(f"reference: authors' ms_deform_attn_core_pytorch, torch {torch_version}, {where}")
    lines.append(f"median of {args.repeats} runs after a warm-up, seconds; ratio = torch / ours (> 1: ours faster)")
    lines.append("")
    lines.append(
        f"| {'implementation':<34} | {'forward':>8} | {'fwd+bwd':>8} | {'ratio fwd':>9} | {'ratio fwd+bwd':>13} |"
    )
    lines.append(f"|{'-' * 36}|{'-' * 10}|{'-' * 10}|{'-' * 11}|{'-' * 15}|")

    timings = []

    def row(name, fwd, both):
        timings.append((name, fwd, both))
        return f"| {name:<34} | {fwd:8.3f} | {both:8.3f} | {torch_fwd / fwd:9.2f} | {torch_both / both:13.2f} |"

    lines.append(row(f"torch core ({where})", torch_fwd, torch_both))
    authors_op = time_authors_cuda_op(shapes, arrays, args.repeats) if args.torch_device == "cuda" else None
    if authors_op is not None:
        lines.append(row("authors' CUDA op (cuda)", *authors_op))
    for backend in kernels.available_backends():
        lines.append(row(f"kernels, backend={backend}", *time_kernels(backend, shapes, arrays, args.repeats)))
    text = "\n".join(lines)
    print(text)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
        groups = [(name, [("forward", fwd), ("fwd+bwd", both)]) for name, fwd, both in timings]
        bars("ms_deform_attn, encoder shape: seconds (shorter is faster)", groups, args.output.with_suffix(".png"))


if __name__ == "__main__":
    main()
