"""An exponential moving average of the weights, for evaluation, the best checkpoint and the commands."""

import math
from contextlib import contextmanager

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten


class EMA:
    """An exponential moving average of the model's weights, kept in float32: after each optimizer
    step w_ema <- d w_ema + (1 - d) w for every trained weight, with d = decay (1 - exp(-updates /
    warmup)) rising from 0 to `decay` (the warm-up of RT-DETR's and Ultralytics' ModelEMA); frozen
    weights are the model's own."""

    def __init__(self, model, decay: float, warmup: int):
        self.decay, self.warmup = decay, warmup
        self.start(model)

    def start(self, model, weights: dict | None = None, updates: int = 0):
        """From the model's weights, or from `weights` after `updates` (a resumed run)."""
        self.weights = weights or {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())}
        self.updates = updates

    def update(self, model):
        """The next average, lazily (evaluated with the step)."""
        self.updates += 1
        d = self.decay * (1 - math.exp(-self.updates / max(self.warmup, 1)))
        trained = dict(tree_flatten(model.trainable_parameters()))
        for key, value in tree_flatten(model.parameters()):
            average = self.weights[key]
            self.weights[key] = d * average + (1 - d) * value.astype(mx.float32) if key in trained else value

    @contextmanager
    def swapped_in(self, model):
        """The model holds the average inside the block (evaluations), its own weights after."""
        own = model.parameters()
        dtypes = {k: v.dtype for k, v in tree_flatten(own)}
        model.update(tree_unflatten([(k, v.astype(dtypes[k])) for k, v in self.weights.items()]))
        try:
            yield
        finally:
            model.update(own)
