"""The optimizer of the recipe: AdamW with the authors' parameter groups and step decay, and which
layers train."""

import mlx.core as mx
import mlx.optimizers as optim

from ..config import Config


def freeze_for_training(model, cfg: Config):
    """As the authors: the backbone trains (but its stem and layer1, unless `freeze_stem_and_layer1`
    is off) when lr_backbone > 0."""
    model.backbone[0].set_trainable(cfg.optimizer.lr_backbone > 0, cfg.optimizer.freeze_stem_and_layer1)


def _matches(path: str, names) -> bool:
    return any(name in path for name in names)


def build_optimizer(cfg: Config) -> optim.MultiOptimizer:
    """AdamW with the authors' three parameter groups: the backbone at lr_backbone,
    reference_points / sampling_offsets at lr * lr_linear_proj_mult, the rest at lr."""
    o = cfg.optimizer

    def adamw(lr):
        return optim.AdamW(
            learning_rate=lr, betas=[0.9, 0.999], eps=1e-8, weight_decay=o.weight_decay, bias_correction=True
        )

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
