"""The work a workload must do, counted from its shapes, for bench/limits.py: the attention core's taps,
and an R50 forward's convolutions, linear layers and attention taps seen as they run."""

import resource
import sys
import time
from math import prod

import kernels
from deformable_detr.models import backbone, linear

import mlx.core as mx
import mlx.nn as nn
from common import median_time

FLOAT = 4  # bytes


def attention_work(value_shape, locations_shape, both: bool) -> dict:
    """Forward (or forward + backward) of ms_deform_attn on a (B, L, H, C) value and (B, Q, H, levels,
    points, 2) locations. A sample point has 4 bilinear taps; a tap is one value row of C floats.
    Forward: per tap and channel a load and an FMA (out += weight * row). Backward: per tap and channel
    the value row again and an FMA (its dot with the output's gradient, for the location's and the
    weight's gradients), and grad_value's row read, an FMA and written (grad_value += weight * g).
    tap_bytes: the rows' bytes where no row is reused; bytes: every input read once and every output
    written once (where every row is reused from the cache)."""
    batch, length, heads, channels = value_shape
    samples = prod(locations_shape[:-1])
    queries = locations_shape[1]
    tap_channels = 4 * samples * channels
    value, out = batch * length * heads * channels, batch * queries * heads * channels
    inputs = value + samples * 3  # value, x and y, weight
    flop, rows, bytes_ = 2 * tap_channels, tap_channels * FLOAT, (inputs + out) * FLOAT
    formula = (
        f"samples S = B Q H levels points = {samples:,}; FLOP = 4 taps x C x 2 (FMA) x S = {flop / 1e9:.3f} G; "
        f"tap rows = 4 x C x 4 B x S = {rows / 1e9:.3f} GB; once = (value + 3 S + output) x 4 B = {bytes_ / 1e9:.3f} GB"
    )
    if both:  # + the backward: 2 FMA a tap and channel; the value row read, grad_value's read and written
        flop, rows = flop + 2 * 2 * tap_channels, rows + 3 * tap_channels * FLOAT
        bytes_ += (out + inputs) * FLOAT  # the output's gradient read; every input's gradient written once
        formula = (
            f"forward + backward: FLOP = 4 taps x C x (2 + 4) x S = {flop / 1e9:.3f} G; tap rows = 4 x C x 4 B x "
            f"(1 + 3) x S = {rows / 1e9:.3f} GB; once = (2 value + 6 S + 2 output) x 4 B = {bytes_ / 1e9:.3f} GB"
        )
    return {"flop": flop, "tap_bytes": rows, "bytes": bytes_, "formula": formula}


class CoresHad:
    """How many cores this process had while the block ran: its CPU time (every thread's) over the wall
    time. Below the cores it asked for where other work shared the machine; a BLAS thread spinning at a
    barrier counts as had."""

    @staticmethod
    def _cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    def __enter__(self):
        self._start = time.perf_counter(), self._cpu()
        return self

    def __exit__(self, *exc):
        self.cores = (self._cpu() - self._start[1]) / (time.perf_counter() - self._start[0])


class WorkCounter:
    """Records, while active, every convolution and linear layer a forward calls (FLOPs and bytes from
    the shapes it sees, whether its weight trains, whether its input needs a gradient) and the attention
    core's taps. An input needs no gradient where it reached the first trainable layer from frozen ones
    only: here the frozen stem and layer1's output, read by layer2's first block's two layers."""

    PARTS = ("backbone", "input_proj", "transformer.encoder", "transformer.decoder")

    def __init__(self, model):
        self.products, self.attention_tap_channels = [], 0
        # the part of the model each layer belongs to; the rest (reference points, heads): "other"
        self._parts = {
            id(m): next((part for part in self.PARTS if name.startswith(part)), "other")
            for name, m in model.named_modules()
        }
        self._frozen_inputs, self._seen_trainable, self._depth = [], False, 0

    def _record(self, module, x, y, k_in):
        trainable = "weight" in module.trainable_parameters()
        if trainable and not self._seen_trainable:
            self._seen_trainable = True
            self._frozen_inputs.append(x)  # kept: its id stays its own
        needs_grad = self._seen_trainable and not any(x is frozen for frozen in self._frozen_inputs)
        sizes = dict(x=x.size, y=y.size, w=module.weight.size)
        part = self._parts.get(id(module), "other")
        self.products.append(
            dict(flop=2 * y.size * k_in, trainable=trainable, needs_grad=needs_grad, part=part, **sizes)
        )

    def _wrap(self, cls, k_in):
        original = cls.__call__

        def call(module, x, *rest, **named):
            self._depth += 1
            try:
                y = original(module, x, *rest, **named)
            finally:
                self._depth -= 1
            if self._depth == 0:  # a subclass calling its parent's __call__ counts once
                self._record(module, x, y, k_in(module))
            return y

        return original, call

    def __enter__(self):
        conv_k = lambda m: prod(m.weight.shape[1:])  # noqa: E731  (kh x kw x C_in / groups)
        linear_k = lambda m: m.weight.shape[1]  # noqa: E731
        self._saved = []
        for cls, k_in in (
            (nn.Conv2d, conv_k),
            (backbone.Conv2d, conv_k),
            (nn.Linear, linear_k),
            (linear.Linear, linear_k),
        ):
            original, call = self._wrap(cls, k_in)
            self._saved.append((cls, original))
            cls.__call__ = call
        self._attention = kernels.ms_deform_attn

        def attention(value, shapes, starts, locations, weights, **named):
            self.attention_tap_channels += 4 * prod(locations.shape[:-1]) * value.shape[-1]
            return self._attention(value, shapes, starts, locations, weights, **named)

        kernels.ms_deform_attn = attention
        return self

    def __exit__(self, *exc):
        for cls, original in self._saved:
            cls.__call__ = original
        kernels.ms_deform_attn = self._attention


def training_work(counter: WorkCounter, trainable_parameters: int) -> dict:
    """A training step from its forward's records: each trainable layer's weight gradient (cotangent x
    input: its FLOPs again), each input gradient needed (cotangent x weight: again), the attention's
    backward (2 FMA a tap and channel); bytes: the forward's, each gradient product's operands read and
    result written once, AdamW reading parameter, gradient and 2 moments and writing 3 (7 x 4 B a
    trainable parameter)."""
    p = counter.products
    weight_grads = [r for r in p if r["trainable"]]
    input_grads = [r for r in p if r["needs_grad"]]
    flop = sum(r["flop"] for r in p + weight_grads + input_grads)
    moved = sum(r["x"] + r["w"] + r["y"] for r in p)
    moved += sum(r["x"] + r["y"] + 2 * r["w"] for r in weight_grads) + sum(
        r["x"] + r["y"] + r["w"] for r in input_grads
    )
    moved = (moved + 7 * trainable_parameters) * FLOAT
    formula = (
        f"{len(p)} convolutions and linear layers in the forward, {len(weight_grads)} with a weight gradient, "
        f"{len(input_grads)} with an input gradient: products {flop / 1e9:.1f} GFLOP "
        f"(forward {sum(r['flop'] for r in p) / 1e9:.1f}: {by_part(counter)}); "
        f"attention 4 taps x C x (2 + 4) FLOP a sample: {6 * counter.attention_tap_channels / 1e9:.2f} GFLOP; "
        f"bytes: every product's operands and result once, + AdamW 7 x 4 B x {trainable_parameters:,} parameters"
    )
    return {
        "product_flop": flop,
        "attention_flop": 6 * counter.attention_tap_channels,
        "bytes": moved,
        "formula": formula,
    }


def by_part(counter: WorkCounter) -> str:
    """The forward's product GFLOP by part of the model."""
    flop = {part: 0 for part in (*WorkCounter.PARTS, "other")}
    for r in counter.products:
        flop[r["part"]] += r["flop"]
    return ", ".join(f"{part} {value / 1e9:.1f}" for part, value in flop.items())


def inference_work(counter: WorkCounter) -> dict:
    p = counter.products
    flop = sum(r["flop"] for r in p)
    formula = (
        f"{len(p)} convolutions and linear layers, 2 x output elements x (kh kw C_in or inputs): "
        f"{flop / 1e9:.1f} GFLOP ({by_part(counter)}); "
        f"attention 4 taps x C x 2 FLOP a sample: {2 * counter.attention_tap_channels / 1e9:.2f} GFLOP; "
        "bytes: every product's input, weight and output once"
    )
    moved = sum(r["x"] + r["w"] + r["y"] for r in p) * FLOAT
    return {
        "product_flop": flop,
        "attention_flop": 2 * counter.attention_tap_channels,
        "bytes": moved,
        "formula": formula,
    }


def count_work(task: str, size, repeats: int) -> tuple[dict, float, float]:
    """R50 (configs/r50.yaml, bench/model.py's setup) inference at batch 1 or a training step at batch 2
    (checkpointing off): the work counted in one forward, the median time of `repeats`, the cores had."""
    from mlx.utils import tree_flatten
    from model import ours_setup

    _, model, trainer, images, mask, targets = ours_setup(task, size)
    with WorkCounter(model) as counter:
        mx.eval(model(mx.array(images), mx.array(mask)))
    if task == "inference":
        x, m = mx.array(images), mx.array(mask)
        with CoresHad() as had:
            seconds = median_time(lambda: mx.eval(model(x, m)), repeats)
        return inference_work(counter), seconds, had.cores
    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    with CoresHad() as had:
        seconds = median_time(lambda: trainer.step([(images, mask, targets)]), repeats)
    print(f"counted and timed: {task} {size}", file=sys.stderr)
    return training_work(counter, trainable), seconds, had.cores
