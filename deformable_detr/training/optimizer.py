"""The optimizer of the recipe: AdamW with the authors' parameter groups and step decay, and which
layers train."""

from kernels.adamw import adamw_factors, adamw_update

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_reduce

from ..config import Config


def freeze_for_training(model, cfg: Config):
    """As the authors: the backbone trains (but its stem and layer1, unless `freeze_stem_and_layer1`
    is off) when lr_backbone > 0."""
    model.backbone[0].set_trainable(cfg.optimizer.lr_backbone > 0, cfg.optimizer.freeze_stem_and_layer1)


def _matches(path: str, names) -> bool:
    return any(name in path for name in names)


class AdamW(optim.AdamW):
    """mlx.optimizers.AdamW with bias correction, the same numbers, each parameter's step one
    `kernels.adamw_update` (on the CPU one pass on every core, where MLX makes about twelve passes of
    one thread each: 0.25 s of an R50 step at 512 x 683 on 2 cores), its gradient first multiplied by
    `gradient_scale` (gradient clipping's factor: `clip_and_update`), None for 1."""

    gradient_scale = None

    def __init__(self, learning_rate, betas, eps, weight_decay):
        super().__init__(
            learning_rate=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=True
        )
        self._factors = None

    def apply_gradients(self, gradients: dict, parameters: dict):
        self._factors = None  # this step's, made at its first parameter (after the step count moved)
        return super().apply_gradients(gradients, parameters)

    def apply_single(self, gradient: mx.array, parameter: mx.array, state: dict):
        if self._factors is None:
            self._factors = adamw_factors(
                self.learning_rate, self.weight_decay, *self.betas, self.step, self.gradient_scale
            )
        parameter, state["m"], state["v"] = adamw_update(
            parameter, gradient, state["m"], state["v"], self._factors, *self.betas, self.eps
        )
        return parameter


def clip_and_update(optimizer: optim.MultiOptimizer, model, grads: dict, max_norm: float) -> mx.array:
    """optim.clip_grad_norm(grads, max_norm) and optimizer.update(model, clipped), the same numbers, the
    clipping's multiply done in each parameter's AdamW pass instead of a pass of its own. -> the
    gradients' global norm before clipping."""
    norm = mx.sqrt(tree_reduce(lambda total, g: total + g.square().sum(), grads, 0.0))
    scale = mx.minimum(max_norm / (norm + 1e-6), 1.0)
    for sub in optimizer.optimizers:
        sub.gradient_scale = scale
    try:
        optimizer.update(model, grads)
    finally:
        for sub in optimizer.optimizers:
            sub.gradient_scale = None
    return norm


def build_optimizer(cfg: Config) -> optim.MultiOptimizer:
    """AdamW with the authors' three parameter groups: the backbone at lr_backbone,
    reference_points / sampling_offsets at lr * lr_linear_proj_mult, the rest at lr."""
    o = cfg.optimizer

    def adamw(lr):
        return AdamW(learning_rate=lr, betas=[0.9, 0.999], eps=1e-8, weight_decay=o.weight_decay)

    return optim.MultiOptimizer(
        [adamw(o.lr_backbone), adamw(o.lr * o.lr_linear_proj_mult), adamw(o.lr)],
        [lambda path, _: path.startswith("backbone.0"), lambda path, _: _matches(path, o.lr_linear_proj_names)],
    )


def base_learning_rates(cfg: Config):
    o = cfg.optimizer
    return [o.lr_backbone, o.lr * o.lr_linear_proj_mult, o.lr]


def set_epoch_learning_rates(optimizer, cfg: Config, epoch: int):
    """Step decay: every rate x 0.1 once per `lr_drop` epochs (the authors' StepLR)."""
    factor = 0.1 ** (epoch // cfg.schedule.lr_drop)
    for sub, base in zip(optimizer.optimizers, base_learning_rates(cfg), strict=True):
        sub.learning_rate = mx.array(base * factor)
