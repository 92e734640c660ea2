"""`DeformableDETR`: backbone, input projections, deformable transformer and the detection heads;
`post_process` turns its outputs into scored boxes. A port of the authors' `models/deformable_detr.py`."""

import math

import mlx.core as mx
import mlx.nn as nn

from ..config import ModelConfig
from .backbone_base import BackboneBase, resize_mask
from .box_ops import box_cxcywh_to_xyxy
from .combinations import GROUPS, check_model
from .convolution import Conv2d
from .deformable_transformer import DeformableTransformer, inverse_sigmoid
from .linear import Linear
from .position_encoding import PositionEmbeddingSine
from .precision import GroupNorm, float32_heads, to
from .query_groups import LEARNED, from_source, query_groups, running, spans


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


def _projected(projection, x, dtype):
    """An input projection ([Conv2d, GroupNorm]) of a map: the convolution takes the map as the backbone left it
    (bfloat16 where its products ran in bfloat16) and gives `dtype` (the images'), one pass where a cast made
    another before it."""
    convolution, norm = projection
    return norm(convolution(x, dtype=dtype))


class DeformableDETR(nn.Module):
    """images (B, H, W, 3) normalised, mask (B, H, W) True on padding -> dict with `pred_logits`
    (B, Q, num_classes), `pred_boxes` (B, Q, 4) normalised cx, cy, w, h, `aux_outputs` (one such dict
    per earlier decoder layer) and, for two-stage, `enc_outputs` (the encoder's proposals): the predictions of the
    detector's queries. The query groups (query_groups.py) that run in training only add theirs under their names,
    in training: H-Deformable-DETR's hybrid branch's under `one2many` (`pred_logits`, `pred_boxes`,
    `aux_outputs`); at inference their queries are not run.

    Without box refinement the authors share one class head and one box head across decoder layers;
    here they are stored once (`class_embed.0`, `bbox_embed.0`). With refinement every layer has its
    own (plus one for the encoder proposals in two-stage), also used by the decoder to refine.
    `m`, the config's model section: num_classes, num_queries, num_feature_levels, aux_loss, with_box_refine,
    two_stage, and what query_groups reads (mixed_selection, num_queries_one2many)."""

    def __init__(self, backbone: BackboneBase, transformer: DeformableTransformer, m: ModelConfig):
        super().__init__()
        hidden_dim, num_classes, two_stage = transformer.d_model, m.num_classes, m.two_stage
        check_model(m)  # for a model built here from Python; the commands check it before anything else
        self.groups = query_groups(m)
        self.num_queries, self.num_feature_levels = m.num_queries, m.num_feature_levels
        self.aux_loss, self.with_box_refine, self.two_stage = m.aux_loss, m.with_box_refine, two_stage
        self.backbone = [backbone]  # the authors' Joiner: backbone.0 is the ResNet, backbone.1 the encoding
        self.position_embedding = self.position_encoding(m)
        self.transformer = transformer

        num_layers = len(transformer.decoder.layers)
        num_pred = num_layers + 1 if two_stage else num_layers
        num_heads = num_pred if m.with_box_refine else 1
        self.class_embed = [ClassHead(hidden_dim, num_classes) for _ in range(num_heads)]
        self.bbox_embed = [MLP(hidden_dim, hidden_dim, 4, 3) for _ in range(num_heads)]
        if learned := from_source(self.groups, LEARNED, "contents"):  # with their positions, or those alone
            width = hidden_dim * 2 if from_source(self.groups, LEARNED) else hidden_dim
            self.query_embed = nn.Embedding(learned, width)
        self.input_proj = self.input_projections(backbone.num_channels, hidden_dim, m.num_feature_levels)
        self._reset_parameters()

    @staticmethod
    def position_encoding(m: ModelConfig) -> PositionEmbeddingSine:
        return PositionEmbeddingSine(m.hidden_dim // 2, m.position_temperature, offset=m.position_offset)

    @staticmethod
    def input_projections(in_channels, hidden_dim: int, levels: int) -> list:
        """Each backbone map's 1 x 1 convolution and group norm to `hidden_dim`, then the extra levels' 3 x 3
        stride-2 convolutions from the last map."""
        projections = [
            [Conv2d(c, hidden_dim, 1), GroupNorm(GROUPS, hidden_dim, pytorch_compatible=True)] for c in in_channels
        ]
        extra_in = in_channels[-1]
        for _ in range(levels - len(in_channels)):
            projections.append(
                [Conv2d(extra_in, hidden_dim, 3, 2, 1), GroupNorm(GROUPS, hidden_dim, pytorch_compatible=True)]
            )
            extra_in = hidden_dim
        return projections

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

    def features(self, images: mx.array, mask: mx.array):
        """The transformer's input: per level the projected map (B, h, w, d), its padding mask (B, h, w) and its
        position encoding."""
        features = self.backbone[0](images, mask)
        srcs = [_projected(self.input_proj[level], x, images.dtype) for level, (x, _) in enumerate(features)]
        masks = [m for _, m in features]
        for level in range(len(features), self.num_feature_levels):
            x = features[-1][0] if level == len(features) else srcs[-1]
            srcs.append(_projected(self.input_proj[level], x, images.dtype))
            masks.append(resize_mask(mask, srcs[-1].shape[1], srcs[-1].shape[2]))
        pos = [to(self.position_embedding(m), src.dtype) for m, src in zip(masks, srcs, strict=True)]
        return srcs, masks, pos

    def __call__(self, images: mx.array, mask: mx.array) -> dict:
        groups = running(self.groups, self.training)
        num_layers = len(self.transformer.decoder.layers)
        queries = sum(g.count for g in groups)
        hs, init_reference, references, enc_class, enc_coord = self.transformer(
            *self.features(images, mask),
            groups,
            query_embed=self.query_embed.weight[:queries] if "query_embed" in self else None,
            proposal_heads=(self.head(self.class_embed, num_layers), self.head(self.bbox_embed, num_layers))
            if self.two_stage
            else None,
            refine_heads=self.bbox_embed if self.with_box_refine else None,
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

        out = self.group_predictions(outputs, groups)
        if self.two_stage:
            out["enc_outputs"] = {"pred_logits": enc_class, "pred_boxes": mx.sigmoid(enc_coord)}
        return out

    def group_predictions(self, layers: list[dict], groups) -> dict:
        """The detector's queries' predictions (the first group's), and every other group's under its name."""
        at = spans(groups)
        out = self._predictions(layers, at[groups[0].name])
        for group in groups[1:]:
            out[group.name] = self._predictions(layers, at[group.name])
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
