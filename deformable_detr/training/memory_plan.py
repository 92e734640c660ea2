"""The memory plan of a training run, made where its trainer is built (`Trainer.from_config`): the
micro-batch and whether to recompute activations in the backward, where the config says `auto`, and
a clear stop, never a crash, where a step would not fit. On MLX's CPU back-end a failed allocation is
a segmentation fault (and `mx.set_memory_limit` is not enforced there), so before the first step
`plan_memory` estimates the peak of the largest batch the data can produce, from small probe steps,
and refuses to start when it exceeds the budget; on Metal an allocation failure during a step ends
with the same advice (`out_of_memory_message`).

The estimate: MLX's peak memory during a step is a constant (weights, optimizer state) plus a part
proportional to the pixels of the batch (activations: the backbone's feature maps, the encoder's
tokens, the attention's samples all scale with them), so two probes at small sizes of the same
shape give the line to extrapolate. The probes are 1/8 and 1/4 of a large batch's pixels: a probe's
own peak is the process's too (MLX's peak, and the resident memory malloc keeps), and at 1/4 and 1/2
the second probe of the R50 planned for 512 x 683 images (a largest batch of 1250 x 1250 px) peaked at
5,439 MiB, twice the 2,860 of the 512 x 683 step it ran, and above PyTorch's whole step (bench/README.md,
"The memory check's probes set the step's peak")."""

import gc
import math
import os
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..data.transforms import resized_shape
from ..errors import CommandError
from ..models.query_groups import PROPOSALS, from_source

GIB = 1024**3


def advice(checkpointing: bool) -> str:
    """What to lower; turning on activation checkpointing only where it is off."""
    turn_on = "" if checkpointing else ", or turn on train.activation_checkpointing"
    return (
        f"lower schedule.micro_batch_size, data.scales / data.max_size (the image size){turn_on}; "
        "or raise train.memory_limit_gb if the machine has the memory"
    )


class MemoryBudgetError(CommandError):
    """A training step would need more memory than the budget."""


def largest_image(width: int, height: int, data_cfg) -> tuple[int, int]:
    """The tallest and the widest (height, width) the train augmentations can make of an image:
    the resize to the largest scale, or a crop (of the tallest or widest shape allowed) resized to it."""
    scale = max(data_cfg.scales)
    resized = resized_shape(width, height, scale, data_cfg.max_size)
    heights, widths = [resized[0]], [resized[1]]
    low, high = data_cfg.crop_size
    for size in data_cfg.crop_resize:
        h, w = resized_shape(width, height, size)
        tall = (min(h, high), min(low, w))  # (crop height, crop width)
        wide = (min(low, h), min(w, high))
        for crop_h, crop_w in (tall, wide):
            final_h, final_w = resized_shape(crop_w, crop_h, scale, data_cfg.max_size)
            heights.append(final_h)
            widths.append(final_w)
    return max(heights), max(widths)


def largest_batch(image_sizes, data_cfg) -> tuple[int, int]:
    """(height, width) of the largest padded batch: the tallest image's height and the widest's width
    (a batch pads to both; one of a single image is no larger)."""
    shapes = [largest_image(w, h, data_cfg) for w, h in set(image_sizes)]
    return max(h for h, _ in shapes), max(w for _, w in shapes)


def machine_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def budget_bytes(train_cfg) -> int:
    """train.memory_limit_gb, or 80% of the machine's memory."""
    if train_cfg.memory_limit_gb > 0:
        return int(train_cfg.memory_limit_gb * GIB)
    return int(0.8 * machine_memory())


@dataclass
class Estimate:
    peak_bytes: float  # MLX's peak during a step of the largest batch, plus the optimizer's first state
    batch: int
    height: int
    width: int
    probes: list  # ((height, width), peak bytes) of each probe step

    def describe(self) -> str:
        return f"{self.peak_bytes / GIB:.1f} GiB for a micro-batch of {self.batch} x {self.height} x {self.width} px"


def probe_peak(loss_and_grad, batch: int, height: int, width: int, num_classes: int) -> int:
    """MLX's peak memory during one forward and backward on a synthetic batch (nothing is updated)."""
    rng = np.random.default_rng(0)
    images = mx.array(rng.standard_normal((batch, height, width, 3)).astype(np.float32))
    mask = mx.zeros((batch, height, width), dtype=mx.bool_)
    boxes = np.array([[0.3, 0.3, 0.2, 0.2], [0.6, 0.6, 0.3, 0.4]], np.float32)
    targets = [{"labels": np.array([1, num_classes - 1]), "boxes": boxes} for _ in range(batch)]
    gc.collect()  # arrays that wait for Python's cycle collector would otherwise be freed at some moment of the probe
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    (total, _), grads = loss_and_grad(images, mask, targets, float(2 * batch))
    mx.eval(total, grads)
    peak = mx.get_peak_memory()
    del total, grads
    mx.clear_cache()
    return peak


def estimate_step_memory(trainer, batch: int, height: int, width: int, num_classes: int) -> Estimate:
    """Extrapolate MLX's peak for a (batch, height, width) step from probes at 1/8 and 1/4 of its
    pixels (sides / 2 sqrt 2 and / 2, at least 64 px), at 1/4 and 1/2 for a step under 8 x 256 x 256 px.
    Measured on the R50 at batch 2 for 1250 x 1250: 10,752 MiB estimated against 10,612 measured
    (probes of 1,580 and 2,890 MiB, 14 s); from 1/4 and 1/2, 10,533 (probes of 2,890 and 5,439 MiB,
    29 s); from 1/16 and 1/8, 10,855."""
    # Under 8 x 256 x 256 px, 1/4 and 1/2 (such probes cost little): the tests' tiny model at 256 x 320 came
    # out 22% under its measured peak from 1/8 and 1/4, whose probes (91 x 113) are too small for the line
    # (its fixed parts still decide their peaks).
    factors = (2.0 * 2.0**0.5, 2.0) if height * width >= 8 * 256 * 256 else (2.0, 2.0**0.5)
    # two-stage takes its queries (H-Deformable-DETR's hybrid branch's too) from the encoder's tokens, about 4/3
    # per 8 x 8 pixels: a probe must have as many
    model = trainer.model
    queries = from_source(model.groups, PROPOSALS)
    smallest = max(64, math.ceil((queries * 48) ** 0.5))
    probes = []
    for factor in factors:
        size = (max(smallest, round(height / factor)), max(smallest, round(width / factor)))
        probes.append((size, probe_peak(trainer.loss_and_grad, batch, *size, num_classes)))
    (size_a, peak_a), (size_b, peak_b) = probes
    pixels_a, pixels_b = size_a[0] * size_a[1], size_b[0] * size_b[1]
    slope = max(peak_b - peak_a, 0) / max(pixels_b - pixels_a, 1)
    peak = peak_b + slope * (height * width - pixels_b)
    has_moments = any(path.endswith((".m", ".v")) for path, _ in tree_flatten(trainer.optimizer.state))
    if not has_moments:  # AdamW's first update makes two moments and the new weights
        peak += 3 * sum(v.nbytes for _, v in tree_flatten(trainer.model.trainable_parameters()))
    return Estimate(peak, batch, height, width, probes)


def plan_memory(trainer, image_sizes, share: int, log=None) -> Estimate:
    """The plan for `trainer` (its model, optimizer and config) on images of `image_sizes` ((width,
    height) of each), `share` images per process and step: `plan_micro_batch`, with
    `train.activation_checkpointing: auto` resolved: off when a step without it fits the budget
    (faster: nothing is recomputed), else on. The config (`schedule.micro_batch_size`,
    `train.activation_checkpointing`) and the model are set to the choices, which are logged. -> the
    estimated peak of a step of the largest micro-batch."""
    cfg = trainer.cfg
    if cfg.train.activation_checkpointing != "auto":
        trainer.model.set_activation_checkpointing(cfg.train.activation_checkpointing)
        return plan_micro_batch(trainer, image_sizes, share, log)
    for checkpointing in (False, True):
        cfg.train.activation_checkpointing = checkpointing
        trainer.model.set_activation_checkpointing(checkpointing)
        try:
            estimate = plan_micro_batch(trainer, image_sizes, share, log)
        except MemoryBudgetError:
            if checkpointing:
                raise
            continue
        if log is not None:
            why = "a step without it fits" if not checkpointing else "a step without it would not fit"
            log(f"memory: train.activation_checkpointing auto -> {str(checkpointing).lower()} ({why})")
        return estimate


def plan_micro_batch(trainer, image_sizes, share: int, log=None) -> Estimate:
    """The micro-batch size to train with, set in `schedule.micro_batch_size`: as given, or for `auto`
    the largest that divides the process's `share` of the batch and fits the budget (from probes of 1
    and 2 images: the peak grows by the same amount with every image). -> the estimated peak of a
    micro-batch of the largest images the data can produce. Raise MemoryBudgetError (its message
    names the estimate, the budget and what to lower) when even that does not fit. `log`: told what
    is being measured before the probe steps run."""
    cfg = trainer.cfg
    height, width = largest_batch(image_sizes, cfg.data)
    micro, num_classes = cfg.schedule.micro_batch_size, cfg.model.num_classes
    if log is not None:
        what = "a micro-batch of 1 and of 2" if micro == "auto" else f"a micro-batch of {micro}"
        log(f"memory: the largest images the data can produce pad to {height} x {width} px; probe steps of {what}")
    if micro == "auto":
        one = estimate_step_memory(trainer, 1, height, width, num_classes)
        two = estimate_step_memory(trainer, 2, height, width, num_classes) if share > 1 else one
        per_image = max(two.peak_bytes - one.peak_bytes, 0.0)
        peaks = {m: one.peak_bytes + (m - 1) * per_image for m in range(1, share + 1) if share % m == 0}
        fitting = [
            m for m, peak in peaks.items() if peak + _accumulator(trainer, share // m) <= budget_bytes(cfg.train)
        ]
        micro = max(fitting, default=1)
        estimate = Estimate(peaks[micro], micro, height, width, one.probes + two.probes)
    else:
        estimate = estimate_step_memory(trainer, micro, height, width, num_classes)
    estimate.peak_bytes += _accumulator(trainer, share // micro)
    budget = budget_bytes(cfg.train)
    if log is not None:
        log(f"memory: a step of the largest micro-batch needs {estimate.describe()} (budget {budget / GIB:.1f} GiB)")
    if estimate.peak_bytes > budget:
        source = "train.memory_limit_gb" if cfg.train.memory_limit_gb > 0 else "80% of this machine's memory"
        raise MemoryBudgetError(
            f"a training step of the largest micro-batch the data can produce would need about {estimate.describe()} "
            f"(estimated from probe steps), over the memory budget of {budget / GIB:.1f} GiB ({source}); "
            f"{advice(cfg.train.activation_checkpointing)}"
        )
    cfg.schedule.micro_batch_size = micro
    return estimate


def _accumulator(trainer, micro_batches: int) -> int:
    """The gradients accumulated over the micro-batches of a step: one more copy of the trainable weights."""
    return sum(v.nbytes for _, v in tree_flatten(trainer.model.trainable_parameters())) if micro_batches > 1 else 0


def is_out_of_memory(error: BaseException) -> bool:
    """MLX's allocation failure (Metal: "[malloc] Unable to allocate ...")."""
    return isinstance(error, RuntimeError) and ("[malloc]" in str(error) or "Unable to allocate" in str(error))


def out_of_memory_message(error: BaseException, images_shape, checkpointing: bool) -> str:
    b, h, w = images_shape[:3]
    return f"out of memory in a training step of a micro-batch of {b} x {h} x {w} px ({error}); {advice(checkpointing)}"
