"""The whole detector as one ONNX graph on a fixed canvas, inputs and outputs as transformers names
them; `--postprocess` adds the top-k detections in pixels. Mirrors DeformableDETR.__call__ and
post_process (models/deformable_detr.py)."""

import numpy as np
import onnx

from ...models.denoising import DINO_EPS
from ...models.detectors import ARCHITECTURES
from ...models.query_groups import LEARNED, PROPOSALS, from_source, query_groups, running
from ..check import detections_kept
from .attention import Sizes
from .backbone import input_projections, resnet
from .builder import FLOAT, INT64, Graph
from .dino import dino_decoder, dino_queries, head_of
from .encoding import flatten, level_mask, position_embedding, valid_ratios
from .proposals import two_stage_queries
from .transformer import decoder, encoder, inverse_sigmoid, mlp, single_stage_queries

TOP_K = 100  # post_process's default; an export keeps its config's evaluation.top_k (DINO's: 300, its num_select)


def levels(g: Graph, srcs: list, not_mask: str, canvas: tuple, cfg) -> dict:
    """Each level's source, position embedding (the architecture's encoding, with its level embedding), mask and
    valid extent, flattened and concatenated as DeformableTransformer does."""
    encoding = ARCHITECTURES[cfg.architecture][0].position_encoding(cfg)
    level_embed = g.weight("transformer.level_embed")
    flat = {"src": [], "pos": [], "mask": [], "extent": [], "ratio": [], "levels": []}
    start = 0
    for level, (src, hw) in enumerate(srcs):
        mask = level_mask(g, not_mask, canvas, hw)
        pos = position_embedding(g, mask, hw, encoding)
        flat["pos"].append(g.Add(pos, g.const(level_embed[level], f"transformer.level_embed.{level}")))
        flat["src"].append(flatten(g, src, cfg.hidden_dim, hw))
        flat["mask"].append(g.reshape(mask, (-1, hw[0] * hw[1], 1)))
        extent, ratio = valid_ratios(g, mask, hw)
        flat["extent"].append(extent)
        flat["ratio"].append(ratio)
        flat["levels"].append((hw[0], hw[1], start))
        start += hw[0] * hw[1]
    return {key: value if key in ("extent", "ratio", "levels") else g.concat(value, 1) for key, value in flat.items()}


def heads(g: Graph, tgt: str, reference: str, ref_dims: int, index: int, eps: float = 1e-5) -> tuple:
    """The last decoder layer's class logits and boxes (sigmoid of the box head's delta on the
    reference's logits, inverse_sigmoid at `eps`)."""
    logits = g.linear(tgt, f"class_embed.{index}")
    delta = mlp(g, tgt, f"bbox_embed.{index}")
    if ref_dims == 4:
        return logits, g.Sigmoid(g.Add(delta, inverse_sigmoid(g, reference, eps)))
    centre, size = g.split(delta, [2, 2], -1)
    return logits, g.Sigmoid(g.concat([g.Add(centre, inverse_sigmoid(g, reference, eps)), size], -1))


def deformable_detr_predictions(g: Graph, memory: str, flat: dict, sizes: Sizes, groups, cfg) -> tuple:
    """The authors' (and H-Deformable-DETR's) queries, decoder and heads: DeformableTransformer.__call__ from
    the memory, DeformableDETR.__call__'s last layer."""
    per_layer_heads = "class_embed.1.weight" in g.weights
    if from_source(groups, PROPOSALS):
        proposal_heads = cfg.dec_layers if per_layer_heads else 0
        queries = two_stage_queries(g, memory, flat["mask"], flat["extent"], sizes, groups, proposal_heads)
    else:
        queries = single_stage_queries(g, sizes.batch, cfg.hidden_dim, from_source(groups, LEARNED))
    tgt, reference, ref_dims = decoder(g, queries, memory, flat["ratio"], flat["mask"], sizes, cfg)
    return heads(g, tgt, reference, ref_dims, cfg.dec_layers - 1 if per_layer_heads else 0)


def dino_predictions(g: Graph, memory: str, flat: dict, sizes: Sizes, groups, cfg) -> tuple:
    """DINO's queries, decoder and shared heads: DINOTransformer.__call__ from the memory, DINO.__call__'s last
    layer."""
    queries = dino_queries(g, memory, flat["mask"], flat["extent"], sizes, groups)
    tgt, reference = dino_decoder(g, queries, memory, flat["ratio"], flat["mask"], sizes, cfg)
    return heads(g, tgt, reference, 4, head_of(g, cfg.dec_layers - 1), DINO_EPS)


PREDICTIONS = {"deformable_detr": deformable_detr_predictions, "dino": dino_predictions}  # by model.architecture


def detector(g: Graph, cfg, canvas: tuple, batch: int, sampler: str) -> tuple:
    """pixel_values (N, 3, H, W), pixel_mask (N, H, W) -> logits (N, Q, classes), boxes (N, Q, 4)."""
    pixel_values = g.input("pixel_values", FLOAT, (batch, 3, *canvas))
    not_mask = g.Cast(g.input("pixel_mask", INT64, (batch, *canvas)), to=FLOAT)
    features = resnet(g, pixel_values, cfg, canvas)
    features = features if cfg.num_feature_levels > 1 else features[-1:]
    srcs = input_projections(g, features, cfg.num_feature_levels, cfg.hidden_dim)
    flat = levels(g, srcs, not_mask, canvas, cfg)
    length = sum(h * w for h, w, _ in flat["levels"])
    heads_dim = cfg.hidden_dim // cfg.nheads
    enc_sizes = Sizes(batch, cfg.nheads, cfg.enc_n_points, heads_dim, tuple(flat["levels"]), length, sampler)
    memory = encoder(g, flat["src"], flat["pos"], flat["ratio"], flat["mask"], enc_sizes, cfg.enc_layers)
    dec_sizes = Sizes(batch, cfg.nheads, cfg.dec_n_points, heads_dim, tuple(flat["levels"]), length, sampler)
    groups = running(query_groups(cfg), training=False)  # the detector's queries: those an inference runs
    return PREDICTIONS[cfg.architecture](g, memory, flat, dec_sizes, groups, cfg)


def post_process(g: Graph, logits: str, boxes: str, batch: int, queries: int, classes: int, top_k: int) -> tuple:
    """target_sizes (N, 2) (height, width) -> the top-k (query, class) pairs by sigmoid score (k = top_k, at most
    every pair: check.detections_kept): scores (N, k), labels (N, k), boxes (N, k, 4) x0, y0, x1, y1 in pixels, as
    model.post_process."""
    target_sizes = g.Cast(g.input("target_sizes", INT64, (batch, 2)), to=FLOAT)
    probabilities = g.reshape(g.Sigmoid(logits), (batch, queries * classes))
    scores, top = g.op("TopK", probabilities, g.ints([top_k], "k"), axis=1, largest=1, sorted=1, outputs=2)
    labels = g.Mod(top, g.ints(classes))
    query = g.Div(top, g.ints(classes))
    cx, cy, w, h = g.split(boxes, [1, 1, 1, 1], -1)
    half_w, half_h = g.Mul(w, g.scalar(0.5)), g.Mul(h, g.scalar(0.5))
    corners = g.concat([g.Sub(cx, half_w), g.Sub(cy, half_h), g.Add(cx, half_w), g.Add(cy, half_h)], -1)
    rows = g.Add(query, g.ints((np.arange(batch) * queries)[:, None], "batch_rows"))
    corners = g.Gather(g.reshape(corners, (batch * queries, 4)), rows, axis=0)  # (N, k, 4)
    scale = g.unsqueeze(g.Gather(target_sizes, g.ints([1, 0, 1, 0], "whwh"), axis=1), [1])  # (N, 1, 4)
    return scores, labels, g.Mul(corners, scale)


def build_graph(
    weights: dict, cfg, canvas: tuple, batch: int = 1, postprocess: bool = False, sampler="gather", top_k=TOP_K
):
    """This port's weights (numpy, by parameter name) and ModelConfig -> the ONNX model; with `postprocess`, an
    image's best `top_k` detections."""
    g = Graph(weights)
    logits, boxes = detector(g, cfg, canvas, batch, sampler)
    classes, queries = g.weight("class_embed.0.bias").shape[0], cfg.num_queries
    if postprocess:
        top_k = detections_kept(cfg, top_k)
        scores, labels, corners = post_process(g, logits, boxes, batch, queries, classes, top_k)
        g.output(scores, "scores", FLOAT, (batch, top_k))
        g.output(labels, "labels", INT64, (batch, top_k))
        g.output(corners, "boxes", FLOAT, (batch, top_k, 4))
    else:
        g.output(logits, "logits", FLOAT, (batch, queries, classes))
        g.output(boxes, "pred_boxes", FLOAT, (batch, queries, 4))
    variant = "two-stage" if cfg.two_stage else "box refinement" if cfg.with_box_refine else "single stage"
    name = ARCHITECTURES[cfg.architecture][0].__name__  # DeformableDETR, DINO
    doc = f"{name} ({cfg.backbone}, {variant}, {cfg.num_feature_levels} levels), {canvas[0]} x {canvas[1]}"
    model = g.model("deformable_detr", doc)
    onnx.checker.check_model(model)
    return model
