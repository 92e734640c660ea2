"""Two-stage: the encoder's proposals, scored and the top `num_queries` taken (TopK) in the graph,
become the decoder's queries. Mirrors DeformableTransformer.encoder_proposals, proposal_pos_embed
and the two-stage branch of its __call__."""

import math

import numpy as np

from .attention import Sizes
from .builder import FLOAT, Graph
from .encoding import sine
from .transformer import mlp, pixel_centres


def proposals(g: Graph, memory: str, not_mask: str, extents: list, sizes: Sizes) -> tuple:
    """memory (N, L, d), not_mask (N, L, 1), extents: per level (N, 1, 2) unpadded width and height
    -> (the memory the proposals are scored from (N, L, d), proposals in logit space (N, L, 4), inf
    where padded or within 0.01 of the border)."""
    boxes = []
    for level, ((h, w, _), extent) in enumerate(zip(sizes.levels, extents, strict=True)):
        centres = g.Div(g.const(pixel_centres(h, w), "pixel_centres"), extent)  # (N, hw, 2)
        size = np.full((1, 1, 2), 0.05 * 2.0**level, np.float32)  # a square of the level's scale
        size = g.Expand(g.const(size, "proposal_size"), g.ints([sizes.batch, h * w, 2], "proposal_shape"))
        boxes.append(g.concat([centres, size], -1))
    boxes = g.concat(boxes, 1)
    inside = g.And(g.Greater(boxes, g.scalar(0.01)), g.Less(boxes, g.scalar(0.99)))
    valid = g.ReduceMin(g.Cast(inside, to=FLOAT), axes=[-1], keepdims=1)  # all four inside
    invalid = g.Or(g.Equal(not_mask, g.scalar(0.0)), g.Equal(valid, g.scalar(0.0)))
    logits = g.Log(g.Div(boxes, g.Sub(g.scalar(1.0), boxes)))
    boxes = g.Where(invalid, g.scalar(math.inf), logits)
    memory = g.Where(invalid, g.scalar(0.0), memory)
    memory = g.layer_norm(g.linear(memory, "transformer.enc_output"), "transformer.enc_output_norm")
    return memory, boxes


def two_stage_queries(g: Graph, memory: str, not_mask: str, extents: list, sizes: Sizes, cfg, heads: int) -> tuple:
    """The top `num_queries` proposals by their first class's logit -> (tgt, query_pos, reference
    (N, Q, 4), 4), tgt learnt with mixed selection. `heads`: the index of the proposal heads (class_embed /
    bbox_embed)."""
    memory, boxes = proposals(g, memory, not_mask, extents, sizes)
    enc_class = g.linear(memory, f"class_embed.{heads}")
    enc_coord = g.Add(mlp(g, memory, f"bbox_embed.{heads}"), boxes)
    first_class = g.squeeze(g.slice(enc_class, 2, 0, 1), [2])  # (N, L)
    _, top = g.op("TopK", first_class, g.ints([cfg.num_queries], "k"), axis=1, largest=1, sorted=1, outputs=2)
    rows = g.Add(top, g.ints((np.arange(sizes.batch) * sizes.length)[:, None], "batch_rows"))
    top_coords = g.Gather(g.reshape(enc_coord, (-1, 4)), rows, axis=0)  # (N, Q, 4)
    reference = g.Sigmoid(top_coords)
    angles = g.unsqueeze(g.Mul(reference, g.scalar(2 * math.pi)), [3])  # (N, Q, 4, 1)
    embedded = g.reshape(sine(g, angles, cfg.hidden_dim // 2), (sizes.batch, cfg.num_queries, 2 * cfg.hidden_dim))
    embedded = g.layer_norm(g.linear(embedded, "transformer.pos_trans"), "transformer.pos_trans_norm")
    query_pos, tgt = g.split(embedded, [cfg.hidden_dim, cfg.hidden_dim], -1)
    if cfg.mixed_selection:  # H-Deformable-DETR's: the contents learnt, the first `num_queries` (the one-to-one)
        contents = g.const(g.weight("query_embed.weight")[: cfg.num_queries], "query_contents")
        tgt = g.Expand(contents, g.ints([sizes.batch, cfg.num_queries, cfg.hidden_dim], "query_shape"))
    return tgt, query_pos, reference, 4
