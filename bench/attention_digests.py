"""sha256 digests of `kernels.ms_deform_attn(backend="cpu")`'s output and three gradients on fixed
seeded inputs, so that "bit for bit as before" is a diff of two files.

    python bench/attention_digests.py [--output FILE] [--save DIR] [--compare DIR]

Inputs: a small problem (2 levels, 3 heads x 32 channels, border padding off) and the encoder shape
on uniform and encoder-like points (bench/attention.py's `inputs`), each value (B, L, H, C), the
output's cotangent standard normal (seed 1). `--save DIR` keeps the arrays as .npz; `--compare DIR`
prints the largest absolute and relative differences from arrays saved by an earlier build.
"""

import hashlib
import sys
from pathlib import Path

import kernels
from deformable_detr.errors import ArgumentParser, entry_point

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import ENCODER, inputs  # noqa: E402
from common import report  # noqa: E402

SMALL = dict(batch=2, shapes=((9, 7), (4, 3)), heads=3, channels=32, points=4)
NAMES = ("output", "grad_value", "grad_locations", "grad_weights")


def cases():
    """(name, shapes, (value, locations, weights)) of each fixed problem."""
    yield "small uniform", SMALL["shapes"], inputs(**SMALL, seed=3)
    yield "small encoder", SMALL["shapes"], inputs(**SMALL, seed=3, where="encoder")
    yield "encoder-shape uniform", ENCODER["shapes"], inputs(**ENCODER)
    yield "encoder-shape encoder", ENCODER["shapes"], inputs(**ENCODER, where="encoder")


def results(shapes, arrays):
    """The output and the gradients of value, locations and weights, as numpy arrays."""
    value, locations, weights = (mx.array(a) for a in arrays)
    b, q, h = weights.shape[:3]
    rng = np.random.default_rng(1)
    cotangent = mx.array(rng.standard_normal((b, q, h * value.shape[3]), dtype=np.float32))

    def attend(v, locs, w):
        return kernels.ms_deform_attn(v, shapes, None, locs, w, backend="cpu")

    (out,), grads = mx.vjp(attend, [value, locations, weights], [cotangent])
    return [np.array(a) for a in (out, *grads)]


def differences(got, want):
    """Largest absolute difference, and largest relative one where the earlier value is not tiny."""
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    scale = np.abs(want.astype(np.float64))
    relative = diff / np.maximum(scale, 1e-3 * max(scale.max(), 1e-30))
    return float(diff.max()), float(relative.max())


@entry_point
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, help="also write the digests to this file")
    parser.add_argument("--save", type=Path, help="keep the arrays in this folder (.npz)")
    parser.add_argument("--compare", type=Path, help="folder of arrays saved earlier: print the differences")
    args = parser.parse_args(argv)
    lines = ["sha256 (first 16 hex digits) of kernels.ms_deform_attn(backend='cpu') results, float32 bytes"]
    for case, shapes, arrays in cases():
        arrays_out = results(shapes, arrays)
        for name, a in zip(NAMES, arrays_out, strict=True):
            lines.append(f"{case:22} {name:15} {hashlib.sha256(a.tobytes()).hexdigest()[:16]}")
        stem = case.replace(" ", "_")
        if args.save:
            args.save.mkdir(parents=True, exist_ok=True)
            np.savez(args.save / f"{stem}.npz", **dict(zip(NAMES, arrays_out, strict=True)))
        if args.compare:
            before = np.load(args.compare / f"{stem}.npz")
            for name, a in zip(NAMES, arrays_out, strict=True):
                absolute, relative = differences(a, before[name])
                lines.append(f"{case:22} {name:15} max abs {absolute:.3g}, max rel {relative:.3g} vs before")
    if args.output:
        report(lines, args.output)
    else:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
