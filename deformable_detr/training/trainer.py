"""The trainer: one optimisation step, and the first step's check that every `sampling_offsets` layer
learns; built with its memory plan. The loop around it is `engine.py`."""

import contextlib
import math
import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map

from ..config import Config
from ..errors import CommandError, UsageError
from ..models import build_criterion
from ..models.denoising import DenoisingQueries, denoising_queries, draw_noise
from ..models.precision import DTYPES, computing_in, to, widened
from ..models.query_groups import KNOWN
from .ema import EMA
from .memory_plan import plan_memory
from .optimizer import build_optimizer, clip_and_update, freeze_for_training

BRANCHES = {  # a group's losses, as the gradient check names them
    "one2many": "the hybrid branch's losses (_one2many)",
    "denoising": "the denoising queries' losses (_dn)",
}


class GradientCheckError(CommandError):
    """A `sampling_offsets` layer got a zero or non-finite gradient on the first step."""


def sampling_offsets_grad_norms(grads) -> dict:
    """Gradient norm of every sampling_offsets layer (weight and bias together), by module path, as
    lazy arrays (evaluated with the step)."""
    squares = {}
    for path, grad in tree_flatten(grads):
        match = re.match(r"(.*\.sampling_offsets)\.(weight|bias)$", path)
        if match:
            squares[match[1]] = squares.get(match[1], 0.0) + (grad.astype(mx.float32) ** 2).sum()
    return {path: mx.sqrt(total) for path, total in squares.items()}


def check_sampling_offsets(norms: dict, losses: str = ""):
    """`norms`: sampling_offsets_grad_norms of the gradient of the loss, or of `losses` (named in the error)."""
    losses = f" of {losses}" if losses else ""
    bad = {path: norm for path, norm in norms.items() if not math.isfinite(norm) or norm == 0.0}
    if not norms:
        raise GradientCheckError(
            f"no sampling_offsets layer received a gradient{losses}: they would never learn where to look"
        )
    if bad:
        listed = ", ".join(f"{path} = {norm}" for path, norm in bad.items())
        raise GradientCheckError(
            f"sampling_offsets gradient{losses} is zero or not finite on the first step: {listed} "
            "(turn this check off with train.check_sampling_offsets=false)"
        )


def process_share(cfg: Config, world_size: int) -> int:
    """Images per process and step: its share of `schedule.batch_size`. A batch that does not split
    into processes x micro-batches is a UsageError naming the numbers."""
    batch, micro = cfg.schedule.batch_size, cfg.schedule.micro_batch_size
    if batch < 1 or (micro != "auto" and micro < 1):
        raise UsageError(f"schedule.batch_size ({batch}) and schedule.micro_batch_size ({micro}) must be at least 1")
    if batch % world_size:
        raise UsageError(f"schedule.batch_size ({batch}) does not divide over {world_size} processes")
    share = batch // world_size
    if micro != "auto" and micro > share:
        raise UsageError(
            f"schedule.micro_batch_size ({micro}) is above each process's share of schedule.batch_size "
            f"({batch} / {world_size} process(es) = {share})"
        )
    if micro != "auto" and share % micro:
        raise UsageError(
            f"schedule.batch_size ({batch}) is not a multiple of {world_size} process(es) x "
            f"schedule.micro_batch_size ({micro})"
        )
    return share


def seed_step(seed: int, global_step: int):
    """Seed MLX's generator (dropout) from the run's seed and the step."""
    mx.random.seed((seed * 1_000_003 + global_step) % 2**32)


class Trainer:
    """One optimisation step: forward, matched losses, backward, (all-reduce), clip, AdamW.
    `mx.eval` once per step, and nothing evaluates before it: the Hungarian matching and the CPU
    attention kernel are lazy MLX operations, so MLX frees each intermediate as soon as the backward
    is done with it (an evaluation inside the differentiated function would keep them all).

    On its first step the trainer measures the gradient of every `sampling_offsets` layer
    (`sampling_offsets_grad_norms`) and, with `train.check_sampling_offsets`, stops with
    GradientCheckError if one is zero or not finite: that layer could never learn where to look. With
    H-Deformable-DETR's hybrid branch it checks the gradient of the branch's losses alone as well (one more
    forward and backward on the first micro-batch), so that neither branch's queries look in vain; so with every
    query group that runs in training only (DINO's denoising: query_groups.py).

    With DINO's denoising group, each micro-batch's noised copies of its targets (models/denoising.py) are drawn
    from a generator seeded by the run's seed, the global step and the micro-batch: a resumed run draws the same."""

    def __init__(self, model, criterion, optimizer, cfg: Config, group=None):
        self.model, self.criterion, self.optimizer, self.cfg = model, criterion, optimizer, cfg
        t = cfg.train
        self.ema = EMA(model, t.ema_decay, t.ema_warmup) if t.ema_decay > 0 else None
        self.group = group
        self.world_size = group.size() if group is not None else 1
        self.loss_and_grad = nn.value_and_grad(model, self._loss)
        self.steps = 0  # taken by this trainer
        self.sampling_offsets_grad_norms = None  # of the first step, by layer
        # each further group's losses alone: {group name: norms by layer}, of the first step
        self.branch_grad_norms = {}
        self.branches = [g for g in model.groups[1:] if g.training_only]
        self.denoising = next((g for g in self.branches if g.assignment == KNOWN), None)

    @classmethod
    def from_config(cls, model, cfg: Config, image_sizes, group=None, log=None):
        """The trainer of `cfg` for `model`: the recipe's frozen layers, AdamW with the authors'
        parameter groups, the matched losses; data parallel over `group` when it has several
        processes; and its memory plan for training images of `image_sizes` ((width, height) each,
        `dataset.image_sizes()`): `auto` micro-batch and activation checkpointing resolved in `cfg`
        (`memory_plan.py`; `log` is told), or a MemoryBudgetError where a step would not fit."""
        share = process_share(cfg, group.size() if group is not None else 1)
        freeze_for_training(model, cfg)
        mx.eval(model.parameters())  # materialise the initial weights once, before any step reseeds MLX's generator
        parallel = group is not None and group.size() > 1
        trainer = cls(model, build_criterion(cfg), build_optimizer(cfg), cfg, group if parallel else None)
        trainer.memory_estimate = plan_memory(trainer, image_sizes, share, log)
        return trainer

    @property
    def micro_batch_size(self) -> int:
        return self.cfg.schedule.micro_batch_size

    def evaluation_weights(self):
        """A context in which the model holds the weights to evaluate: the EMA where there is one."""
        return self.ema.swapped_in(self.model) if self.ema is not None else contextlib.nullcontext()

    def denoising_queries(self, targets, seed) -> DenoisingQueries | None:
        """The micro-batch's denoising queries, their noise drawn from a generator seeded by `seed`; None without
        the group."""
        if self.denoising is None:
            return None
        m = self.cfg.model
        noise = draw_noise(
            np.random.default_rng(seed), targets, m.dn_number, m.num_classes, m.dn_label_noise_ratio,
            m.dn_box_noise_scale,
        )  # fmt: skip
        return denoising_queries(targets, m.dn_number, noise, m.dn_label_noise_ratio, m.dn_box_noise_scale)

    def _loss(self, images, mask, targets, num_boxes, seed=(0,)):
        dtype = DTYPES[self.cfg.train.precision]
        denoising = self.denoising_queries(targets, seed)
        with computing_in(self.model, dtype):
            outputs = self.model(to(images, dtype), mask, **({"denoising": denoising} if denoising else {}))
        outputs = tree_map(widened, outputs)  # the matching and the losses in float32
        losses = self.criterion(outputs, targets, num_boxes, denoising)
        return self.criterion.total(losses), losses

    def _branch_loss(self, images, mask, targets, num_boxes, seed, suffix):
        """The weighted losses of the query group whose loss names end in `suffix`, alone."""
        _, losses = self._loss(images, mask, targets, num_boxes, seed)
        weights = self.criterion.weight_dict
        return sum(value * weights[k] for k, value in losses.items() if k.endswith(suffix) and k in weights)

    def num_boxes(self, targets) -> float:
        """Target boxes per process, averaged over processes (the authors' normalisation)."""
        count = mx.array(float(sum(len(t["labels"]) for t in targets)))
        if self.world_size > 1:
            count = mx.distributed.all_sum(count, group=self.group) / self.world_size
        return count.item()  # the criterion divides by at least 1 (the hybrid branch by k times this)

    def step(self, micro_batches, global_step: int = 0) -> tuple[dict, float]:
        """One optimizer step over this process's share of the batch, given as micro-batches of
        (images, mask, targets): their gradients accumulate, each loss normalised by the boxes of the
        whole batch (averaged over processes, as the authors'), so that the step equals one over the
        whole batch at once. `global_step` seeds the denoising noise. -> (the losses as floats, the gradients'
        global norm before clipping)."""
        images_in_step = sum(len(targets) for _, _, targets in micro_batches)
        num_boxes = self.num_boxes([target for _, _, targets in micro_batches for target in targets])
        seeds = [(self.cfg.seed, global_step, i) for i in range(len(micro_batches))]
        if self.steps == 0:  # before the first update, as the step's gradient
            self.branch_grad_norms = {
                group.name: self.branch_norms(*micro_batches[0], num_boxes, seeds[0], group.loss_suffix)
                for group in self.branches
            }
        grads = total = losses = None
        for (images, mask, targets), seed in zip(micro_batches, seeds, strict=True):
            arrays = mx.array(images), mx.array(mask)
            (part_total, parts), part_grads = self.loss_and_grad(*arrays, targets, num_boxes, seed)
            # the losses add up; the logged-only errors (class, cardinality) are means over the images
            share = len(targets) / images_in_step
            parts = {k: v if k in self.criterion.weight_dict else v * share for k, v in parts.items()}
            if grads is None:
                grads, total, losses = part_grads, part_total, parts
            else:
                grads = tree_map(mx.add, grads, part_grads)
                total, losses = total + part_total, {k: v + parts[k] for k, v in losses.items()}
            # evaluated before the update: in one graph with it, MLX's order kept more of the backward's
            # activations alive (an R50 step of 2 images at 512 x 683 peaked at 3.7 GiB instead of 3.1)
            mx.eval(grads, total, losses)
        return self._update(grads, total, losses)

    def branch_norms(self, images, mask, targets, num_boxes, seed, suffix) -> dict:
        """sampling_offsets_grad_norms of a query group's losses alone (those ending in `suffix`) on one
        micro-batch (nothing updated)."""
        loss_and_grad = nn.value_and_grad(self.model, self._branch_loss)
        _, grads = loss_and_grad(mx.array(images), mx.array(mask), targets, num_boxes, seed, suffix)
        norms = sampling_offsets_grad_norms(grads)
        mx.eval(norms)
        return {k: v.item() for k, v in norms.items()}

    def _update(self, grads, total, losses) -> tuple[dict, float]:
        if self.world_size > 1:
            grads = tree_map(lambda g: mx.distributed.all_sum(g, group=self.group) / self.world_size, grads)
        max_norm = self.cfg.optimizer.clip_max_norm
        first_norms = sampling_offsets_grad_norms(grads) if self.steps == 0 else {}
        grad_norm = clip_and_update(self.optimizer, self.model, grads, max_norm if max_norm > 0 else math.inf)
        if self.ema is not None:
            self.ema.update(self.model)
        ema = self.ema.weights if self.ema is not None else {}
        mx.eval(self.model.parameters(), self.optimizer.state, ema, total, losses, grad_norm, first_norms)
        self.steps += 1
        if self.steps == 1:
            self.sampling_offsets_grad_norms = {k: v.item() for k, v in first_norms.items()}
            if self.cfg.train.check_sampling_offsets:
                check_sampling_offsets(self.sampling_offsets_grad_norms)
            for group in self.branches if self.cfg.train.check_sampling_offsets else ():
                check_sampling_offsets(self.branch_grad_norms[group.name], BRANCHES[group.name])
        values = {k: v.item() for k, v in losses.items()}
        values["loss"] = total.item()
        if self.world_size > 1:  # report the mean over processes
            stacked = mx.distributed.all_sum(mx.array([values[k] for k in values]), group=self.group)
            values = dict(zip(values, (stacked / self.world_size).tolist(), strict=True))
        return values, grad_norm.item()
