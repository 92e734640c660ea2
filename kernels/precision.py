"""`bfloat16_products()`: whether bfloat16 products are fast where MLX computes now, and why; the one
answer the model's precision (deformable_detr/models/precision.py), the benchmarks and the tests ask.

Fast: on a GPU (MLX's own bfloat16 kernels), or on the CPU through oneDNN where it has AMX or
AVX512-BF16 kernels for them (onednn.bfloat16_kernels, which asks oneDNN itself). Not fast: a CPU
without those instructions (AVX2 only, or AVX-512 without BF16), or one where oneDNN is not used:
there MLX's CPU bfloat16 products are about 20x slower than its float32 (a 2048^2 product 3.9 s against
0.19 s), and a bfloat16 run would be slower than float32, not faster."""

import statistics
import time
from dataclasses import dataclass
from functools import cache

import mlx.core as mx

from . import onednn
from .onednn import work


def bfloat16_products() -> tuple[bool, str]:
    """(fast, why): whether bfloat16 products run faster than float32 on the default device, and why."""
    device = mx.default_device()
    if device.type != mx.cpu:
        return True, f"MLX's bfloat16 products on {device}"
    why_not = onednn.bfloat16_kernels()
    if why_not is not None:
        return False, why_not
    return True, f"this CPU has {', '.join(onednn.bfloat16_instructions()) or 'bfloat16 instructions'} (oneDNN)"


# Where bfloat16 pays (`bfloat16_rule`): a product runs in bfloat16 under a rule only where bfloat16 was at least
# PAYS times as fast as float32 here, for its kind of reduction, at its size and every larger one measured.
# 1.5, not 1.1: products alone, one shape called again and again, gain more than inside a forward (the quick start's
# model serving its val images, 12 clients: auto with a margin of 1.1, bfloat16 from 17 M multiply-adds, served
# 4% fewer requests than float32; with 1.5 the same within the runs' spread, bench/results/serve_precision_cpu.txt).
PAYS = 1.5
NARROW = 64  # reductions shorter than this (a 1 x 1 convolution of 32 channels) fill AMX's tiles poorly
# (what is timed, the reduction's kind, shapes of growing size); a rung's size: its multiply-adds
LADDERS = (
    (
        "3 x 3 convolution of 64 channels",
        "wide",
        [("conv", (1, side, side, 64), (64, 3, 3, 64)) for side in (8, 16, 32, 64)],
    ),
    ("product 256 -> 256", "wide", [("linear", (rows, 256), (256, 256)) for rows in (64, 256, 1024, 4096)]),
    (
        "1 x 1 convolution 32 -> 128",
        "narrow",
        [("conv", (1, side, side, 32), (128, 1, 1, 32)) for side in (16, 32, 64, 128)],
    ),
)


@dataclass(frozen=True)
class BfloatRule:
    """Which products run in bfloat16 at `auto`: those of at least `wide` multiply-adds (None: none) where the
    reduction is at least NARROW long, of at least `narrow` where it is shorter; `measured`: what that rests on."""

    wide: int | None
    narrow: int | None
    measured: str

    def pays(self, multiply_adds: int, reduction: int) -> bool:
        least = self.wide if reduction >= NARROW else self.narrow
        return least is not None and multiply_adds >= least

    @property
    def never(self) -> bool:
        return self.wide is None and self.narrow is None

    def __str__(self) -> str:
        if self.never:
            return f"bfloat16 products measured under {PAYS}x float32's speed here at every size"
        wide = "no product" if self.wide is None else f"products of {self.wide / 1e6:.0f} M multiply-adds or more"
        narrow = "none" if self.narrow is None else f"{self.narrow / 1e6:.0f} M"
        return f"bfloat16 for {wide} (reductions under {NARROW}: {narrow}), float32 for the rest (measured here)"


def _seconds(run, repeats: int = 5) -> float:
    run()  # its plan made, its weight's copy kept
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ratio(kind: str, x_shape, w_shape, kept) -> float:
    """float32's time over bfloat16's for one shape, with kept weights (as a Detector runs them); 0 where oneDNN
    refuses either (then bfloat16 does not pay there)."""
    x, w = mx.random.normal(x_shape), mx.random.normal(w_shape)
    mx.eval(x, w)

    def product():
        return onednn.conv2d(x, w, 1, w_shape[1] // 2) if kind == "conv" else onednn.linear(x, w)

    seconds = {}
    for dtype in (mx.float32, mx.bfloat16):
        with onednn.products_in(dtype, kept):
            if product() is None:
                return 0.0
            seconds[dtype] = _seconds(lambda: mx.eval(product()))
    return seconds[mx.float32] / seconds[mx.bfloat16]


@cache
def bfloat16_rule() -> BfloatRule:
    """Where bfloat16 products pay on this CPU, measured once a process (about 0.1 s): for each of LADDERS, the
    smallest rung from which every rung is at least PAYS times as fast in bfloat16 as in float32; the wide
    reductions' threshold the larger of theirs. For `auto` (deformable_detr/models/precision.py): a CPU whose
    bfloat16 kernels are slower than its float32 ones (AVX512-BF16 without AMX on an Intel Xeon: 0.5-0.7x)
    runs float32, and small products (a small model, small images) stay float32 where bfloat16 does not pay."""
    fast, why = bfloat16_products()
    if not fast or mx.default_device().type != mx.cpu:
        return BfloatRule(None, None, why)
    kept, least, said = onednn.kept_weights(), {"wide": [], "narrow": []}, []
    with mx.stream(mx.cpu):
        for name, reduction, rungs in LADDERS:
            sizes = [work(kind, x, w, 1, w[1] // 2 if kind == "conv" else 0)[0] for kind, x, w in rungs]
            ratios = [_ratio(*rung, kept) for rung in rungs]
            paying = [i for i in range(len(rungs)) if all(r >= PAYS for r in ratios[i:])]
            least[reduction].append(sizes[paying[0]] if paying else None)
            said.append(
                f"{name}: " + " ".join(f"{size / 1e6:.1f}M {r:.2f}x" for size, r in zip(sizes, ratios, strict=True))
            )
    wide = None if None in least["wide"] else max(least["wide"])
    return BfloatRule(wide, least["narrow"][0], "; ".join(said))
