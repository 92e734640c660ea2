"""The deformable transformer as ONNX: encoder, decoder with box refinement, the single-stage
queries (two-stage's: proposals.py). Mirrors deformable_transformer.py; tokens (N, L, d)."""

import numpy as np

from .attention import Sizes, deformable_attention, self_attention
from .builder import Graph


def pixel_centres(h: int, w: int) -> np.ndarray:
    """(1, h * w, 2): (x + 0.5, y + 0.5) of every pixel of a level, row-major."""
    y, x = np.meshgrid(np.arange(h, dtype=np.float32) + 0.5, np.arange(w, dtype=np.float32) + 0.5, indexing="ij")
    return np.stack([x.reshape(-1), y.reshape(-1)], -1)[None]


def mlp(g: Graph, x: str, prefix: str, num_layers: int = 3) -> str:
    """model.MLP: linear layers (named layers.0, layers.1, ...) with ReLU between them."""
    for i in range(num_layers):
        x = g.linear(x, f"{prefix}.layers.{i}")
        x = g.Relu(x) if i < num_layers - 1 else x
    return x


def feed_forward(g: Graph, x: str, prefix: str) -> str:
    return g.linear(g.Relu(g.linear(x, f"{prefix}.linear1")), f"{prefix}.linear2")


def inverse_sigmoid(g: Graph, x: str, eps: float = 1e-5) -> str:
    x = g.Clip(x, g.scalar(0.0), g.scalar(1.0))
    return g.Log(g.Div(g.Max(x, g.scalar(eps)), g.Max(g.Sub(g.scalar(1.0), x), g.scalar(eps))))


def encoder(g: Graph, src: str, pos: str, valid_ratios: list, not_mask: str, sizes: Sizes, layers: int) -> str:
    """src, pos (N, L, d); valid_ratios: per level (N, 1, 2); not_mask (N, L, 1) -> memory (N, L, d)."""
    points = [
        g.Div(g.const(pixel_centres(h, w), "pixel_centres"), g.Mul(ratio, g.const([w, h], "level_wh")))
        for (h, w, _), ratio in zip(sizes.levels, valid_ratios, strict=True)
    ]  # per level (N, hw, 2): pixel centres over the unpadded extent
    ratios = g.concat(valid_ratios, 1)  # (N, levels, 2)
    reference = g.Mul(g.unsqueeze(g.concat(points, 1), [2]), g.unsqueeze(ratios, [1]))  # (N, L, levels, 2)
    for i in range(layers):
        prefix = f"transformer.encoder.layers.{i}"
        attended = deformable_attention(g, f"{prefix}.self_attn", g.Add(src, pos), reference, 2, src, not_mask, sizes)
        src = g.layer_norm(g.Add(src, attended), f"{prefix}.norm1")
        src = g.layer_norm(g.Add(src, feed_forward(g, src, prefix)), f"{prefix}.norm2")
    return src


def refine(g: Graph, tgt: str, reference: str, ref_dims: int, head: str, eps: float = 1e-5) -> str:
    """Box refinement: the box head's delta on the reference's logits (inverse_sigmoid at `eps`) -> (N, Q, 4)."""
    delta = mlp(g, tgt, head)
    if ref_dims == 4:
        return g.Sigmoid(g.Add(delta, inverse_sigmoid(g, reference, eps)))
    centre, size = g.split(delta, [2, 2], -1)
    return g.Sigmoid(g.concat([g.Add(centre, inverse_sigmoid(g, reference, eps)), size], -1))


def seen_from_levels(g: Graph, reference: str, ref_dims: int, ratios: str) -> str:
    """reference (N, Q, 2|4), ratios (N, levels, 2) -> (N, Q, levels, 2|4): the reference scaled by every level's
    valid ratios (twice for boxes), as the decoder samples at it."""
    return g.Mul(g.unsqueeze(reference, [2]), g.unsqueeze(ratios if ref_dims == 2 else g.concat([ratios] * 2, -1), [1]))


def decoder_layer(
    g: Graph,
    i: int,
    tgt: str,
    query_pos: str,
    scaled: str,
    ref_dims: int,
    memory: str,
    not_mask: str,
    sizes: Sizes,
    cfg,
) -> str:
    """DeformableTransformerDecoderLayer `i`: self-attention, deformable attention at `scaled` (N, Q, levels,
    2|4), feed-forward -> its output (N, Q, d)."""
    prefix = f"transformer.decoder.layers.{i}"
    q = g.Add(tgt, query_pos)
    attended = self_attention(g, f"{prefix}.self_attn", q, tgt, cfg.hidden_dim, cfg.nheads, sizes.batch)
    tgt = g.layer_norm(g.Add(tgt, attended), f"{prefix}.norm2")
    attended = deformable_attention(
        g, f"{prefix}.cross_attn", g.Add(tgt, query_pos), scaled, ref_dims, memory, not_mask, sizes
    )
    tgt = g.layer_norm(g.Add(tgt, attended), f"{prefix}.norm1")
    return g.layer_norm(g.Add(tgt, feed_forward(g, tgt, prefix)), f"{prefix}.norm3")


def decoder(g: Graph, queries: tuple, memory: str, valid_ratios: list, not_mask: str, sizes: Sizes, cfg) -> tuple:
    """queries: (tgt, query_pos, reference (N, Q, 2|4), its size). Returns the last layer's output
    (N, Q, d), the reference it was given and that reference's size (2 or 4)."""
    tgt, query_pos, reference, ref_dims = queries
    ratios = g.concat(valid_ratios, 1)  # (N, levels, 2)
    layers = cfg.dec_layers
    for i in range(layers):
        scaled = seen_from_levels(g, reference, ref_dims, ratios)
        tgt = decoder_layer(g, i, tgt, query_pos, scaled, ref_dims, memory, not_mask, sizes, cfg)
        if cfg.with_box_refine and i < layers - 1:  # the last layer's refinement is the output's box
            reference, ref_dims = refine(g, tgt, reference, ref_dims, f"bbox_embed.{i}"), 4
    return tgt, reference, ref_dims


def single_stage_queries(g: Graph, batch: int, d_model: int, queries: int) -> tuple:
    """The first `queries` learnt query embeddings (the one-to-one ones: H-Deformable-DETR's hybrid branch has
    more, for training) and their reference points -> (tgt, query_pos, reference, 2)."""
    embedding = g.weight("query_embed.weight")[:queries]  # (Q, 2d): query_pos, tgt
    shape = g.ints([batch, embedding.shape[0], d_model], "query_shape")
    query_pos = g.Expand(g.const(embedding[:, :d_model], "query_pos"), shape)
    tgt = g.Expand(g.const(embedding[:, d_model:], "query_tgt"), shape)
    return tgt, query_pos, g.Sigmoid(g.linear(query_pos, "transformer.reference_points")), 2
