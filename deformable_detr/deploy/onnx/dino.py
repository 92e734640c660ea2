"""DINO's queries and decoder as ONNX (models/dino.py: DINOTransformer, DINODecoder): the encoder's proposals
scored by the encoder's own heads and chosen by their best class, their boxes the queries' first references, the
contents learnt (`tgt_embed`); each decoder layer's query positions made from its reference boxes, its output
normed, the next layer's boxes refined by its box head (shared, or the layer's own: detrex's) from the output before
the norm. The encoder and the decoder layer are the authors' (transformer.py)."""

import math

from ...models.denoising import DINO_EPS
from ...models.query_groups import LEARNED, PROPOSALS, from_source
from .attention import Sizes
from .builder import Graph
from .encoding import sine
from .proposals import best_class, chosen_proposals, learned_contents
from .transformer import decoder_layer, mlp, refine, seen_from_levels

ENCODER_HEADS = ("transformer.enc_out_class_embed", "transformer.enc_out_bbox_embed")


def dino_queries(g: Graph, memory: str, not_mask: str, extents: list, sizes: Sizes, groups) -> tuple:
    """The best proposals by their best class, as many as `groups` take their positions from them -> (tgt: the
    learnt contents (N, Q, d), their boxes (N, Q, 4) in [0, 1])."""
    count, d_model = from_source(groups, PROPOSALS), sizes.heads * sizes.channels
    top_coords = chosen_proposals(g, memory, not_mask, extents, sizes, ENCODER_HEADS, best_class, count)
    contents = learned_contents(g, "transformer.tgt_embed.weight", from_source(groups, LEARNED, "contents"))
    return g.Expand(contents, g.ints([sizes.batch, count, d_model])), g.Sigmoid(top_coords)


def box_sine_embedding(g: Graph, boxes: str, num_feats: int, sizes: Sizes) -> str:
    """(N, Q, 4) boxes cx, cy, w, h -> (N, Q, 4 num_feats): each coordinate times 2 pi, in the order y, x, w, h,
    temperature 10000, as dino.box_sine_embedding."""
    yxwh = g.Gather(boxes, g.ints([1, 0, 2, 3], "yxwh"), axis=2)
    angles = g.unsqueeze(g.Mul(yxwh, g.scalar(2 * math.pi)), [3])  # (N, Q, 4, 1)
    return g.reshape(sine(g, angles, num_feats), (sizes.batch, -1, 4 * num_feats))


def head_of(g: Graph, layer: int) -> int:
    """The index of decoder layer `layer`'s heads: 0 where they are shared (DINO's), else its own (detrex's)."""
    return layer if "bbox_embed.1.layers.0.weight" in g.weights else 0


def dino_decoder(g: Graph, queries: tuple, memory: str, valid_ratios: list, not_mask: str, sizes: Sizes, cfg):
    """queries: (tgt, reference boxes (N, Q, 4)) -> the last layer's normed output (N, Q, d) and the boxes it was
    given (the output's boxes are refined from them)."""
    tgt, reference = queries
    ratios = g.concat(valid_ratios, 1)  # (N, levels, 2)
    layers = cfg.dec_layers
    for i in range(layers):
        scaled = seen_from_levels(g, reference, 4, ratios)  # (N, Q, levels, 4)
        first_level = g.squeeze(g.slice(scaled, 2, 0, 1), [2])
        embedded = box_sine_embedding(g, first_level, cfg.hidden_dim // 2, sizes)
        query_pos = mlp(g, embedded, "transformer.decoder.ref_point_head", num_layers=2)
        tgt = decoder_layer(g, i, tgt, query_pos, scaled, 4, memory, not_mask, sizes, cfg)
        if i < layers - 1:  # the last layer's refinement is the output's box, from the normed output
            reference = refine(g, tgt, reference, 4, f"bbox_embed.{head_of(g, i)}", DINO_EPS)
    return g.layer_norm(tgt, "transformer.decoder.norm"), reference
