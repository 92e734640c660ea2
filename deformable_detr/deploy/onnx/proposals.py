"""Two-stage: the encoder's proposals, scored and the best taken (TopK) in the graph, become the decoder's
queries: their positions and contents (the authors', H-Deformable-DETR's contents learnt), or DINO's boxes
(dino.py). Mirrors DeformableTransformer.encoder_proposals, proposals, proposal_pos_embed and the two-stage
branch of its __call__."""

import math

import numpy as np

from ...models.query_groups import LEARNED, PROPOSALS, from_source
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


def first_class(g: Graph, enc_class: str) -> str:
    """The authors' proposal score: the first class's logit, (N, L, C) -> (N, L)."""
    return g.squeeze(g.slice(enc_class, 2, 0, 1), [2])


def best_class(g: Graph, enc_class: str) -> str:
    """DINO's proposal score: the best class's logit, (N, L, C) -> (N, L)."""
    return g.ReduceMax(enc_class, axes=[2], keepdims=0)


def chosen_proposals(
    g: Graph, memory: str, not_mask: str, extents: list, sizes: Sizes, heads: tuple, score, count: int
) -> str:
    """The encoder's proposals scored by `heads` (the class and box heads' prefixes), the best `count` by `score`
    (first_class or best_class) taken, best first (TopK) -> their boxes in logit space (N, count, 4). Mirrors
    DeformableTransformer.proposals and the gather of its top."""
    memory, boxes = proposals(g, memory, not_mask, extents, sizes)
    class_head, box_head = heads
    enc_class = g.linear(memory, class_head)
    enc_coord = g.Add(mlp(g, memory, box_head), boxes)
    _, top = g.op("TopK", score(g, enc_class), g.ints([count], "k"), axis=1, largest=1, sorted=1, outputs=2)
    rows = g.Add(top, g.ints((np.arange(sizes.batch) * sizes.length)[:, None], "batch_rows"))
    return g.Gather(g.reshape(enc_coord, (-1, 4)), rows, axis=0)  # (N, count, 4)


def two_stage_queries(g: Graph, memory: str, not_mask: str, extents: list, sizes: Sizes, groups, heads: int) -> tuple:
    """The best proposals by their first class's logit, as many as `groups` (the query groups that run) take their
    positions from them -> (tgt, query_pos, reference (N, Q, 4), 4); tgt made from them too, or learnt where the
    groups' contents are (mixed selection). `heads`: the index of the proposal heads (class_embed / bbox_embed)."""
    count, d_model = from_source(groups, PROPOSALS), sizes.heads * sizes.channels
    box_heads = (f"class_embed.{heads}", f"bbox_embed.{heads}")
    top_coords = chosen_proposals(g, memory, not_mask, extents, sizes, box_heads, first_class, count)
    reference = g.Sigmoid(top_coords)
    angles = g.unsqueeze(g.Mul(reference, g.scalar(2 * math.pi)), [3])  # (N, Q, 4, 1)
    embedded = g.reshape(sine(g, angles, d_model // 2), (sizes.batch, count, 2 * d_model))
    embedded = g.layer_norm(g.linear(embedded, "transformer.pos_trans"), "transformer.pos_trans_norm")
    query_pos, tgt = g.split(embedded, [d_model, d_model], -1)
    if learned := from_source(groups, LEARNED, "contents"):  # mixed selection (H-Deformable-DETR's): contents learnt
        tgt = g.Expand(learned_contents(g, "query_embed.weight", learned), g.ints([sizes.batch, count, d_model]))
    return tgt, query_pos, reference, 4


def learned_contents(g: Graph, key: str, count: int) -> str:
    """The first `count` rows of the embedding `key`: the learnt contents of the queries that run (H-Deformable-DETR's
    hybrid branch has more, for training) -> (1, count, d)."""
    return g.const(g.weight(key)[None, :count], "query_contents")
