"""Differentiable sampling cores: `grid_sample` (PyTorch semantics, channels-last) and `ms_deform_attn`
(multi-scale deformable attention, Trainium kernel library signature); beside them `linear_assignment`
(batched Hungarian matching as a lazy MLX operation), and `softmax`, `layer_norm`, `patches` (im2col),
`bernoulli16` (random masks), `channel_affine` (a frozen batch norm with its residual and ReLU),
`linear` (its bias rows), `sin_cos`, `masked_scale` (dropout) and `relu` on every CPU core; `onednn`
(convolutions and matrix products on oneDNN, float32 and bfloat16, with their gradients);
`bfloat16_products()` (whether bfloat16 is fast here, and why) and `bfloat16_rule()` (for which products
it pays, measured); and `export_mode()`, within which all of them are MLX ops that `mx.export_function`
can write.

This package knows nothing of DETR. Importing it first sets up the BLAS under MLX's matrix products
(`blas.py`): import it (or deformable_detr) before mlx."""

from . import blas

blas.set_up()

from . import onednn
from .assignment import linear_assignment
from .backends import available as available_backends
from .bernoulli import bernoulli16
from .channel_affine import channel_affine
from .elementwise import add, astype, masked_rows
from .export import export_mode, exporting
from .grid_sample import grid_sample
from .layer_norm import layer_norm
from .linear import linear
from .masked_scale import masked_scale, relu, scale_where_positive
from .ms_deform_attn import BACKENDS, ms_deform_attn
from .patches import patches
from .precision import bfloat16_products, bfloat16_rule
from .sin_cos import sin_cos
from .softmax import softmax

__all__ = [
    "BACKENDS",
    "add",
    "astype",
    "available_backends",
    "bernoulli16",
    "bfloat16_products",
    "bfloat16_rule",
    "channel_affine",
    "export_mode",
    "exporting",
    "grid_sample",
    "layer_norm",
    "linear",
    "linear_assignment",
    "masked_rows",
    "masked_scale",
    "onednn",
    "ms_deform_attn",
    "patches",
    "relu",
    "scale_where_positive",
    "sin_cos",
    "softmax",
]
