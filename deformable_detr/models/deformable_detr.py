"""`DeformableDETR`: backbone, input projections, deformable transformer and the detection heads;
`post_process` turns its outputs into scored boxes. A port of the authors' `models/deformable_detr.py`."""

import math

import mlx.core as mx
import mlx.nn as nn

from ..config import Config, ModelConfig
from .backbone_base import BackboneBase, resize_mask
from .backbones import build_backbone
from .box_ops import box_cxcywh_to_xyxy
from .combinations import GROUPS, check_model
from .convolution import Conv2d
from .deformable_transformer import DeformableTransformer, inverse_sigmoid
from .linear import Linear
from .position_encoding import PositionEmbeddingSine
from .precision import GroupNorm, float32_heads, to


class MLP(nn.Module):
    """Linear layers with ReLU between them. The box head: its products in float32 at any inference
    precision (models/precision.py)."""

    def __init__(self, input_dim: int, hidden_dim: int, output_dim: int, num_layers: int):
        super().__init__()
        dims = [input_dim] + [hidden_dim] * (num_layers - 1) + [output_dim]
        self.layers = [Linear(n, k) for n, k in zip(dims[:-1], dims[1:], strict=True)]

    def __call__(self, x):
        with float32_heads():
            for i, layer in enumerate(self.layers):
                x = layer(x) if i == len(self.layers) - 1 else nn.relu(layer(x))
        return x


class ClassHead(Linear):
    """The class head: its products in float32 at any inference precision (models/precision.py)."""

    def __call__(self, x):
        with float32_heads():
            return super().__call__(x)


def _sequential(layers, x):
    for layer in layers:
        x = layer(x)
    return x


class DeformableDETR(nn.Module):
    """images (B, H, W, 3) normalised, mask (B, H, W) True on padding -> dict with `pred_logits`
    (B, Q, num_classes), `pred_boxes` (B, Q, 4) normalised cx, cy, w, h, `aux_outputs` (one such dict
    per earlier decoder layer) and, for two-stage, `enc_outputs` (the encoder's proposals). With the
    hybrid branch (H-Deformable-DETR's `num_queries_one2many`) and in training, also `one2many`: its
    queries' `pred_logits`, `pred_boxes` and `aux_outputs`; at inference the branch's queries are not run.

    Without box refinement the authors share one class head and one box head across decoder layers;
    here they are stored once (`class_embed.0`, `bbox_embed.0`). With refinement every layer has its
    own (plus one for the encoder proposals in two-stage), also used by the decoder to refine.
    `m`, the config's model section: num_classes, num_queries, num_feature_levels, aux_loss, with_box_refine,
    two_stage, mixed_selection, num_queries_one2many."""

    def __init__(self, backbone: BackboneBase, transformer: DeformableTransformer, m: ModelConfig):
        super().__init__()
        hidden_dim, num_classes, num_queries, two_stage = transformer.d_model, m.num_classes, m.num_queries, m.two_stage
        check_model(m)  # for a model built here from Python; the commands check it before anything else
        self.num_queries, self.num_feature_levels = num_queries, m.num_feature_levels
        self.num_queries_one2many = m.num_queries_one2many
        self.aux_loss, self.with_box_refine, self.two_stage = m.aux_loss, m.with_box_refine, two_stage
        self.backbone = [backbone]  # the authors' Joiner: backbone.0 is the ResNet, backbone.1 the encoding
        self.position_embedding = PositionEmbeddingSine(hidden_dim // 2)
        self.transformer = transformer

        num_layers = len(transformer.decoder.layers)
        num_pred = num_layers + 1 if two_stage else num_layers
        num_heads = num_pred if m.with_box_refine else 1
        self.class_embed = [ClassHead(hidden_dim, num_classes) for _ in range(num_heads)]
        self.bbox_embed = [MLP(hidden_dim, hidden_dim, 4, 3) for _ in range(num_heads)]
        if not two_stage:  # every query's position and content
            self.query_embed = nn.Embedding(num_queries + m.num_queries_one2many, hidden_dim * 2)
        elif m.mixed_selection:  # contents only
            self.query_embed = nn.Embedding(num_queries + m.num_queries_one2many, hidden_dim)

        in_channels = backbone.num_channels
        self.input_proj = [
            [Conv2d(c, hidden_dim, 1), GroupNorm(GROUPS, hidden_dim, pytorch_compatible=True)] for c in in_channels
        ]
        extra_in = in_channels[-1]
        for _ in range(m.num_feature_levels - len(in_channels)):  # extra levels: 3x3 stride-2 convolutions
            self.input_proj.append(
                [Conv2d(extra_in, hidden_dim, 3, 2, 1), GroupNorm(GROUPS, hidden_dim, pytorch_compatible=True)]
            )
            extra_in = hidden_dim
        self._reset_parameters()

    def _reset_parameters(self):
        bias_value = -math.log((1 - 0.01) / 0.01)  # prior probability 0.01 for every class
        for head in self.class_embed:
            head.bias = mx.full(head.bias.shape, bias_value)
        for head in self.bbox_embed:
            last = head.layers[-1]
            last.weight = mx.zeros_like(last.weight)
            last.bias = mx.zeros_like(last.bias)
        if not self.two_stage:  # initial boxes small: sigmoid(-2) ~ 0.12 of the image
            last = self.bbox_embed[0].layers[-1]
            last.bias = mx.concatenate([last.bias[:2], mx.full((2,), -2.0)])
        glorot = nn.init.glorot_uniform()
        for proj in self.input_proj:
            proj[0].weight = glorot(proj[0].weight)
            proj[0].bias = mx.zeros_like(proj[0].bias)

    def head(self, heads, index):
        return heads[index] if len(heads) > 1 else heads[0]

    def set_activation_checkpointing(self, enabled: bool):
        """Recompute the backbone (a ResNet's stages 2-4, every Swin block) and every encoder and decoder layer
        in the backward instead of keeping their intermediates (training only; same gradients, less memory,
        more time)."""
        self.backbone[0].body.activation_checkpointing = enabled
        self.transformer.encoder.activation_checkpointing = enabled
        self.transformer.decoder.activation_checkpointing = enabled

    def __call__(self, images: mx.array, mask: mx.array) -> dict:
        features = self.backbone[0](images, mask)
        srcs = [_sequential(self.input_proj[level], x) for level, (x, _) in enumerate(features)]
        masks = [m for _, m in features]
        for level in range(len(features), self.num_feature_levels):
            srcs.append(_sequential(self.input_proj[level], features[-1][0] if level == len(features) else srcs[-1]))
            masks.append(resize_mask(mask, srcs[-1].shape[1], srcs[-1].shape[2]))
        pos = [to(self.position_embedding(m), src.dtype) for m, src in zip(masks, srcs, strict=True)]

        num_layers = len(self.transformer.decoder.layers)
        queries = self.num_queries + (self.num_queries_one2many if self.training else 0)
        hs, init_reference, references, enc_class, enc_coord = self.transformer(
            srcs,
            masks,
            pos,
            query_embed=self.query_embed.weight[:queries] if "query_embed" in self else None,
            num_queries=queries,
            proposal_heads=(self.head(self.class_embed, num_layers), self.head(self.bbox_embed, num_layers))
            if self.two_stage
            else None,
            refine_heads=self.bbox_embed if self.with_box_refine else None,
            query_groups=(self.num_queries, queries - self.num_queries) if queries > self.num_queries else None,
        )

        outputs = []
        for layer in range(hs.shape[0]):
            reference = inverse_sigmoid(init_reference if layer == 0 else references[layer - 1])
            logits = self.head(self.class_embed, layer)(hs[layer])
            delta = self.head(self.bbox_embed, layer)(hs[layer])
            if reference.shape[-1] == 4:
                delta = delta + reference
            else:
                delta = mx.concatenate([delta[..., :2] + reference, delta[..., 2:]], -1)
            outputs.append({"pred_logits": logits, "pred_boxes": mx.sigmoid(delta)})

        out = self._predictions(outputs, slice(0, self.num_queries))
        if queries > self.num_queries:
            out["one2many"] = self._predictions(outputs, slice(self.num_queries, queries))
        if self.two_stage:
            out["enc_outputs"] = {"pred_logits": enc_class, "pred_boxes": mx.sigmoid(enc_coord)}
        return out

    def _predictions(self, layers: list[dict], queries: slice) -> dict:
        """The last layer's predictions of `queries`, with every earlier layer's as aux_outputs."""
        layers = [{k: v[:, queries] for k, v in layer.items()} for layer in layers]
        out = dict(layers[-1])
        if self.aux_loss:
            out["aux_outputs"] = layers[:-1]
        return out


def post_process(outputs: dict, target_sizes, top_k: int = 100) -> list[dict]:
    """Top-k (query, class) pairs by sigmoid score per image, boxes as x0, y0, x1, y1 in pixels of
    each image's `target_sizes` (B, 2) = (height, width). Returns [{"scores", "labels", "boxes",
    "queries"}], `queries` the decoder query of each detection."""
    logits, boxes = outputs["pred_logits"], outputs["pred_boxes"]
    b, _, num_classes = logits.shape
    target_sizes = mx.array(target_sizes, dtype=mx.float32)
    if target_sizes.shape != (b, 2):
        raise ValueError(f"post_process: target_sizes has shape {tuple(target_sizes.shape)}; expected ({b}, 2)")
    prob = mx.sigmoid(logits).reshape(b, -1)
    top = mx.argsort(-prob, axis=1)[:, :top_k]
    scores = mx.take_along_axis(prob, top, axis=1)
    labels = (top % num_classes).astype(mx.int32)
    queries = (top // num_classes).astype(mx.int32)
    boxes = mx.take_along_axis(box_cxcywh_to_xyxy(boxes), queries[..., None], axis=1)
    h, w = target_sizes[:, 0], target_sizes[:, 1]
    boxes = boxes * mx.stack([w, h, w, h], -1)[:, None, :]
    return [
        {"scores": s, "labels": c, "boxes": x, "queries": q}
        for s, c, x, q in zip(scores, labels, boxes, queries, strict=True)
    ]


def build_model(cfg: Config) -> DeformableDETR:
    check_model(cfg.model)  # before any part is built: their own checks would say less
    model = DeformableDETR(build_backbone(cfg.model), DeformableTransformer(cfg.model), cfg.model)
    model.set_activation_checkpointing(cfg.train.activation_checkpointing is True)  # auto: the memory check sets it
    return model
