"""Precision: the normalisations, which compute in float32 whatever the precision (`LayerNorm`, `GroupNorm`,
the backbone's `FrozenBatchNorm2d`); mixed-precision training; and the precision inference's products run in.

Training (`train.precision: bfloat16`): the weights stay float32 (so do AdamW's moments); in the forward,
every weight but the normalisations' is used as a bfloat16 copy (`computing_in`) and the images are cast to
bfloat16, so the activations are bfloat16 from one operation to the next, the residual stream too; the
normalisations, the softmaxes, the sampling locations and the attention core compute in float32 and hand
bfloat16 on; the outputs go to the losses and the matching in float32. The casts run on every core
(kernels.astype). The gradients reach the float32 weights through the copies. In float32 every cast here is
skipped: the model is exactly the one without it. Evaluation during training runs in float32.

Inference (`--precision auto | float32 | bfloat16`, `Detector.load(precision=)`; eval.py float32 unless
asked): `resolve_precision` decides, once, what runs and why. bfloat16 is oneDNN's, on the CPU only: the
forward runs inside `kernels.onednn.products_in(mx.bfloat16)`, the convolutions' and linears' products in
bfloat16 (but the class and box heads', `float32_heads`).

At inference, what is bfloat16 between the products, and what stays float32, and why (here, once):
- bfloat16: the ResNet's activations from one convolution to the next (its frozen batch norms folded into the
  convolutions, its residuals and ReLUs their post-ops: nothing float32 sits between them,
  convolution.Conv2d.with_batch_norm; the input projections take its maps so and write float32), and an FFN's
  hidden layer (linear1's ReLU its post-op, linear2 taking it as it is: deformable_transformer.feed_forward).
- float32: the residual stream between the transformer's sublayers, which every LayerNorm reads and every
  residual addition accumulates into (bfloat16 would round each layer's sum to 8 bits); the LayerNorms and the
  input projections' GroupNorms (their statistics); the softmaxes (weights summing to 1); the sampling offsets
  and locations (bfloat16 would round them to 1/256 of a level's side) and the attention core, which samples and
  sums in float32; the decoder's self-attention products (MLX's, whose bfloat16 products are slow on a CPU); the
  position encodings (sines of large arguments); the class and box heads and the boxes (the scores and boxes a
  user reads). A product reading the float32 stream converts it on its way in (oneDNN's reorder, every core).

On a GPU every precision runs float32 (MLX's bfloat16 there
is not reached by products_in). `auto` runs bfloat16 only for the products where it pays on this CPU
(kernels.precision.bfloat16_rule, measured once a process: a product must be large enough, and where
bfloat16 kernels are slower than float32 ones, none is): small images and small models stay float32. The
attention view (`predict --attention`) at `auto` runs float32: it shows where the model looks as float32
computes it (bfloat16 moved the points up to 4.2 px at 800 x 1066 on a Zen 4), bfloat16 only when asked."""

from contextlib import contextmanager
from dataclasses import dataclass, replace

import kernels

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from . import recompute

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}


def to(x: mx.array, dtype) -> mx.array:
    """x in `dtype` (between float32 and bfloat16 on every CPU core: kernels.astype)."""
    return kernels.astype(x, dtype)


def widened(x: mx.array) -> mx.array:
    """`x` in float32 where it is a 16-bit float; as it is otherwise (float32, float64)."""
    return kernels.astype(x, mx.float32) if x.dtype in (mx.bfloat16, mx.float16) else x


class LayerNorm(nn.LayerNorm):
    """In float32 (or float64) whatever the input's dtype; the result in the input's. On
    `kernels.layer_norm` (MLX's, faster on the CPU), which reads and writes bfloat16 as it is (computing
    in float32) where widening it and narrowing the result made two more passes each way."""

    def __call__(self, x):
        return kernels.layer_norm(x, widened(self.weight), widened(self.bias), self.eps, dtype=x.dtype)


class GroupNorm(nn.GroupNorm):
    """In float32 (or float64) whatever the input's dtype; the result in the input's. PyTorch's grouping
    (`pytorch_compatible`: each group's channels contiguous) as MLX computes it, the groups' layer norm on
    `kernels.layer_norm` (on every core, where MLX's CPU layer norm is a chain of one-thread passes, and
    its backward the closed form): the same forward."""

    def __call__(self, x):
        if not self.pytorch_compatible:
            return to(super().__call__(widened(x)), x.dtype)
        batch, *_, channels = x.shape
        size = channels // self.num_groups
        # (B, ..., C) -> (B, groups, positions * size): each row one image's group
        groups = x.reshape(batch, -1, self.num_groups, size).transpose(0, 2, 1, 3).reshape(batch, self.num_groups, -1)
        length = groups.shape[-1]
        # float32 from bfloat16 (MLX's promotion by the float32 weight), float64 stays
        normed = kernels.layer_norm(groups, mx.ones((length,)), mx.zeros((length,)), self.eps)
        normed = normed.reshape(batch, self.num_groups, -1, size).transpose(0, 2, 1, 3).reshape(x.shape)
        return to(self.weight * normed + self.bias if "weight" in self else normed, x.dtype)


class FrozenBatchNorm2d(nn.Module):
    """Batch norm with fixed statistics and affine parameters (never trained), and what follows it in
    a ResNet block: `residual` added, then `relu`: `kernels.channel_affine` (one pass on every core,
    where MLX's ops made four on one); in training `recompute.channel_affine`, the same op, whose
    backward keeps only its output. The same numbers either way."""

    def __init__(self, channels: int, eps: float = 1e-5):
        super().__init__()
        self.weight = mx.ones((channels,))
        self.bias = mx.zeros((channels,))
        self.running_mean = mx.zeros((channels,))
        self.running_var = mx.ones((channels,))
        self.eps = eps
        self.freeze()

    def scale_and_shift(self) -> tuple[mx.array, mx.array]:
        """(scale, shift) per channel, float32 (`computing_in` keeps the norm's parameters float32): the norm is
        x * scale + shift. What a convolution folds it into (models/convolution.Conv2d.with_batch_norm)."""
        scale = self.weight * mx.rsqrt(self.running_var + self.eps)
        return scale, self.bias - self.running_mean * scale

    def __call__(self, x, residual=None, relu: bool = False):
        scale, shift = self.scale_and_shift()
        shift = to(shift, x.dtype)
        scale = to(scale, x.dtype)
        if not self.training:
            return kernels.channel_affine(x, scale, shift, residual, relu)
        return recompute.channel_affine(x, scale, shift, residual, relu)


def _kept_in_float32(module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm, FrozenBatchNorm2d))


@contextmanager
def computing_in(model: nn.Module, dtype):
    """Inside, the model's weights (but the normalisations') are `dtype` copies of its own, which it
    holds again after. Used inside the differentiated loss, the copies pass the gradients on."""
    if dtype == mx.float32:
        yield
        return
    own = model.parameters()
    kept = {
        f"{name}.{key}" if name else key
        for name, module in model.named_modules()
        if _kept_in_float32(module)
        for key, _ in tree_flatten(module.parameters())
    }
    cast = [
        (k, v if k in kept or not mx.issubdtype(v.dtype, mx.floating) else kernels.astype(v, dtype))
        for k, v in tree_flatten(own)
    ]
    model.update(tree_unflatten(cast))
    try:
        yield
    finally:
        model.update(own)


INFERENCE_PRECISIONS = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class Precision:
    """The precision a model's products run in (`ran`: float32 or bfloat16), the setting it comes from (one
    of INFERENCE_PRECISIONS) and why this one: `resolve_precision`'s answer, said as `str(precision)`. A
    setting nobody asked for (a command's default, a `Detector` given none) is said to be the default
    (`as_default`): "asked for" is said only of what was asked."""

    ran: str = "float32"
    asked: str = "float32"
    reason: str = "the default"
    # `auto`'s kernels.precision.BfloatRule where bfloat16 ran: only the products it says pay run in bfloat16
    rule: object = None

    def __str__(self) -> str:
        return f"{self.ran} ({self.reason})"

    def as_default(self) -> "Precision":
        """This precision, its setting a default rather than asked (resolve_precision's reason reworded):
        "float32 (the default)", "bfloat16 (auto, the default: ...)"."""
        for said, default in (("asked for", "the default"), (f"{self.asked} asked for", f"{self.asked} by default")):
            if self.reason.startswith(said):
                return replace(self, reason=default + self.reason.removeprefix(said))
        return replace(self, reason=f"{self.asked}, the default: {self.reason.removeprefix(self.asked + ': ')}")

    @property
    def dtype(self) -> mx.Dtype:
        return DTYPES[self.ran]

    def to_json(self) -> dict:
        said = {"ran": self.ran, "asked": self.asked, "reason": self.reason}
        return said if self.rule is None else {**said, "measured": self.rule.measured}


def resolve_precision(asked: str) -> Precision:
    """What runs for `asked` (one of INFERENCE_PRECISIONS), and why: bfloat16 products only where oneDNN
    has bfloat16 kernels (`kernels.bfloat16_products`: AMX or AVX512-BF16) and reaches them (on a GPU the
    forward is float32); there `auto` runs bfloat16 for the products where it pays (the precision's `rule`,
    `kernels.bfloat16_rule`, measured here), float32 for the rest, and float32 throughout where it pays for
    none; `bfloat16` runs every product in bfloat16 there, float32 elsewhere, the reason saying so
    (bfloat16 products there would be slower than float32, or are not there)."""
    if asked not in INFERENCE_PRECISIONS:
        raise ValueError(f"precision {asked!r}: expected one of {', '.join(INFERENCE_PRECISIONS)}")
    if asked == "float32":
        return Precision("float32", asked, "asked for")
    fast, why = kernels.bfloat16_products()
    if fast and mx.default_device().type != mx.cpu:  # products_in reaches oneDNN's products only
        fast, why = False, f"inference's bfloat16 products are oneDNN's: on {mx.default_device()} it is float32"
    if asked == "auto":
        rule = kernels.bfloat16_rule() if fast else None
        if rule is None or rule.never:
            return Precision("float32", asked, f"auto: {why if rule is None else rule}")
        return Precision("bfloat16", asked, f"auto: {rule}; {why}", rule)
    if fast:
        return Precision("bfloat16", asked, f"asked for: {why}")
    return Precision("float32", asked, f"bfloat16 asked for, but {why}")


def check_training_precision(precision: str, even_if_slow: bool) -> str | None:
    """`train.precision`'s problem here, or None: bfloat16 where its products are not fast (about 20x
    slower than float32 on a CPU without bfloat16 instructions) is refused in one line, unless
    `even_if_slow` (train.precision_even_if_slow: true)."""
    if precision != "bfloat16" or even_if_slow:
        return None
    fast, why = kernels.bfloat16_products()
    if fast:
        return None
    return (
        f"train.precision=bfloat16: {why}, so bfloat16 would run slower than float32; use float32, or "
        "insist with train.precision_even_if_slow=true"
    )


def float32_heads():
    """Around the class and box heads: their products in float32 whatever `products_in` asks (a few
    hundred rows: no time), so that the scores and boxes come from float32 products."""
    return kernels.onednn.products_in(mx.float32)
