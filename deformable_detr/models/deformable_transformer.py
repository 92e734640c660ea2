"""Deformable transformer: encoder and decoder layers, single-stage and two-stage, optional iterative
box refinement. A port of the authors' `models/deformable_transformer.py`; tensors are batch-first
and feature maps channels-last."""

import math

import kernels

import mlx.core as mx
import mlx.nn as nn

from ..config import ModelConfig
from .linear import Linear
from .ms_deform_attn import MSDeformAttn
from .position_encoding import sine_embedding
from .precision import LayerNorm, to, widened
from .query_groups import LEARNED, PROPOSALS, attention_plan, from_source
from .recompute import Dropout, checkpointed


def inverse_sigmoid(x: mx.array, eps: float = 1e-5) -> mx.array:
    x = mx.clip(x, 0, 1)
    return mx.log(mx.maximum(x, eps) / mx.maximum(1 - x, eps))


class MultiheadAttention(nn.Module):
    """`torch.nn.MultiheadAttention` (batch-first here), with its parameter names."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        bound = math.sqrt(6 / (d_model + 3 * d_model))
        self.in_proj_weight = mx.random.uniform(-bound, bound, (3 * d_model, d_model))
        self.in_proj_bias = mx.zeros((3 * d_model,))
        self.out_proj = Linear(d_model, d_model)
        self.out_proj.bias = mx.zeros((d_model,))

    def __call__(self, query, key, value, mask=None):
        """`mask`: None, or an additive mask (Q, K) on the scores (-inf where a query may not see a key)."""
        b, q_len, d = query.shape
        w, bias = self.in_proj_weight, self.in_proj_bias
        q = kernels.linear(query, w[:d], bias[:d])
        k = kernels.linear(key, w[d : 2 * d], bias[d : 2 * d])
        v = kernels.linear(value, w[2 * d :], bias[2 * d :])
        head_dim = d // self.n_heads

        def heads(x):  # (B, N, d) -> (B, n_heads, N, head_dim), float32: MLX's bfloat16 products are slow
            return widened(x).reshape(b, -1, self.n_heads, head_dim).transpose(0, 2, 1, 3)

        q, k, v = heads(q), heads(k), heads(v)
        scores = (q * head_dim**-0.5) @ k.transpose(0, 1, 3, 2)
        weights = kernels.softmax(scores if mask is None else scores + mask)
        out = (weights @ v).transpose(0, 2, 1, 3).reshape(b, q_len, d)
        return self.out_proj(to(out, query.dtype))


def with_feed_forward(layer, d_model: int, d_ffn: int, dropout: float, norm: str) -> None:
    """Gives an encoder or decoder layer its last sublayer's parts, in the authors' order (that of the seeded
    initialisation): linear1, linear2, the LayerNorm named `norm`, dropout."""
    layer.linear1 = Linear(d_model, d_ffn)
    layer.linear2 = Linear(d_ffn, d_model)
    setattr(layer, norm, LayerNorm(d_model))
    layer.dropout = Dropout(dropout)


def plus_sublayer(layer, x, sublayer):
    """x + dropout(sublayer's output) for a layer's residual connection: `sublayer(residual)` computes the output
    (+ `residual` where given: the addition as its last product's post-op, oneDNN's, no pass of its own). Where
    the layer's dropout is active (training, p > 0) it sits between, and the addition is a pass of its own."""
    if layer.dropout.active:
        return kernels.add(x, layer.dropout(sublayer(None)))  # every core: MLX's add is a pass on one
    return sublayer(x)


def feed_forward(layer, x, norm):
    """An encoder or decoder layer's last sublayer (the authors' forward_ffn): `layer`'s linear1, ReLU, dropout,
    linear2, dropout, the residual, then `norm`."""
    # The ReLU as linear1's post-op, its result in bfloat16 where the products run in bfloat16 (linear2 takes it as it
    # is, and gives x's dtype back), where oneDNN runs it and no dropout follows (inference; dropout 0); with dropout,
    # ReLU and dropout in one pass (recompute.Dropout).
    hidden = None if layer.dropout.active else layer.linear1.with_relu(x)
    if hidden is None:
        hidden = layer.dropout(layer.linear1(x), after_relu=True)
    return norm(plus_sublayer(layer, x, lambda residual: layer.linear2(hidden, dtype=x.dtype, residual=residual)))


class LayerStack(nn.Module):
    """The encoder's or the decoder's `num_layers` layers, each a LAYER of `layer_args`; with
    `activation_checkpointing`, each layer recomputed in the backward (recompute.py)."""

    LAYER = None

    def __init__(self, num_layers: int, **layer_args):
        super().__init__()
        self.layers = [self.LAYER(**layer_args) for _ in range(num_layers)]
        self.activation_checkpointing = False


class DeformableTransformerEncoderLayer(nn.Module):
    def __init__(self, d_model=256, d_ffn=1024, dropout=0.1, n_levels=4, n_heads=8, n_points=4):
        super().__init__()
        self.self_attn = MSDeformAttn(d_model, n_levels, n_heads, n_points)
        self.norm1 = LayerNorm(d_model)
        with_feed_forward(self, d_model, d_ffn, dropout, "norm2")

    def __call__(self, src, pos, reference_points, spatial_shapes, padding_mask):
        def attention(residual):
            query = kernels.add(src, pos)  # every core: MLX's add is a pass on one
            return self.self_attn(query, reference_points, src, spatial_shapes, None, padding_mask, residual)

        src = self.norm1(plus_sublayer(self, src, attention))
        return feed_forward(self, src, self.norm2)


class DeformableTransformerEncoder(LayerStack):
    LAYER = DeformableTransformerEncoderLayer

    @staticmethod
    def reference_points(spatial_shapes, valid_ratios):
        """Pixel centres of every level, normalised by the unpadded extent, then seen from every
        level: (B, L, n_levels, 2)."""
        points = []
        for level, (h, w) in enumerate(spatial_shapes):
            ref_y, ref_x = mx.meshgrid(
                mx.arange(h, dtype=mx.float32) + 0.5, mx.arange(w, dtype=mx.float32) + 0.5, indexing="ij"
            )
            ref_y = ref_y.reshape(1, -1) / (valid_ratios[:, None, level, 1] * h)
            ref_x = ref_x.reshape(1, -1) / (valid_ratios[:, None, level, 0] * w)
            points.append(mx.stack([ref_x, ref_y], -1))
        points = mx.concatenate(points, 1)
        return points[:, :, None] * valid_ratios[:, None]

    def __call__(self, src, spatial_shapes, valid_ratios, pos, padding_mask):
        reference_points = self.reference_points(spatial_shapes, valid_ratios)
        for layer in self.layers:
            src = checkpointed(
                [layer],
                lambda src, pos, layer=layer: layer(src, pos, reference_points, spatial_shapes, padding_mask),
                src,
                pos,
                enabled=self.activation_checkpointing,
            )
        return src


def seen(keys, values, spans):
    """The keys and values of the query spans `spans` (slices), in their order."""
    if len(spans) == 1:
        return keys[:, spans[0]], values[:, spans[0]]
    return mx.concatenate([keys[:, s] for s in spans], 1), mx.concatenate([values[:, s] for s in spans], 1)


class DeformableTransformerDecoderLayer(nn.Module):
    def __init__(self, d_model=256, d_ffn=1024, dropout=0.1, n_levels=4, n_heads=8, n_points=4):
        super().__init__()
        self.cross_attn = MSDeformAttn(d_model, n_levels, n_heads, n_points)
        self.norm1 = LayerNorm(d_model)
        self.self_attn = MultiheadAttention(d_model, n_heads)
        self.norm2 = LayerNorm(d_model)
        with_feed_forward(self, d_model, d_ffn, dropout, "norm3")

    def __call__(self, tgt, query_pos, reference_points, src, spatial_shapes, padding_mask, attention_plan=None):
        """`attention_plan`: the self-attention over the query groups (query_groups.attention_plan): None for one
        group, else each group's queries attend to the keys of the groups it sees, under its mask. H-Deformable-DETR
        and DINO mask the scores between groups to -inf in one attention; attending over the seen keys alone is the
        same, without the masked scores."""
        q = k = tgt + query_pos
        if attention_plan is None:
            attended = self.self_attn(q, k, tgt)
        else:
            attended = mx.concatenate(
                [self.self_attn(q[:, queries], *seen(k, tgt, keys), mask) for queries, keys, mask in attention_plan],
                axis=1,
            )
        tgt = self.norm2(tgt + self.dropout(attended))
        attended = self.cross_attn(tgt + query_pos, reference_points, src, spatial_shapes, None, padding_mask)
        tgt = self.norm1(tgt + self.dropout(attended))
        return feed_forward(self, tgt, self.norm3)


class DeformableTransformerDecoder(LayerStack):
    LAYER = DeformableTransformerDecoderLayer

    def __init__(self, num_layers: int, look_forward_twice: bool = False, **layer_args):
        super().__init__(num_layers, **layer_args)
        self.look_forward_twice = look_forward_twice

    def __call__(
        self,
        tgt,
        reference_points,
        src,
        spatial_shapes,
        valid_ratios,
        query_pos,
        padding_mask,
        bbox_embed=None,
        attention_plan=None,
    ):
        """Returns every layer's output (n_layers, B, Q, d) and reference points (n_layers, B, Q, 2|4).
        With `bbox_embed` (one head per layer) each layer refines the reference boxes it passes on; the
        next layer samples at them without a gradient, and the boxes each layer returns are those too,
        or, with `look_forward_twice` (H-Deformable-DETR), the refined boxes with their gradient, so
        that the next layer's box loss trains this layer's box head as well."""
        outputs, references = [], []
        for lid, layer in enumerate(self.layers):
            ratios = (
                mx.concatenate([valid_ratios, valid_ratios], -1) if reference_points.shape[-1] == 4 else valid_ratios
            )
            tgt = checkpointed(
                [layer],
                lambda tgt, pos, points, src, layer=layer: layer(
                    tgt, pos, points, src, spatial_shapes, padding_mask, attention_plan
                ),
                tgt,
                query_pos,
                reference_points[:, :, None] * ratios[:, None],
                src,
                enabled=self.activation_checkpointing,
            )
            if bbox_embed is not None:
                delta = bbox_embed[lid](tgt)
                if reference_points.shape[-1] == 4:
                    refined = delta + inverse_sigmoid(reference_points)
                else:
                    refined = mx.concatenate([delta[..., :2] + inverse_sigmoid(reference_points), delta[..., 2:]], -1)
                refined = mx.sigmoid(refined)
                reference_points = mx.stop_gradient(refined)
            outputs.append(tgt)
            references.append(refined if self.look_forward_twice and bbox_embed is not None else reference_points)
        return mx.stack(outputs), mx.stack(references)


class DeformableTransformer(nn.Module):
    def __init__(self, m: ModelConfig):
        """The authors' transformer of the config's model section: `hidden_dim` wide (their d_model), `nheads`
        heads, `enc_layers` and `dec_layers` layers with `dim_feedforward` FFNs, `num_feature_levels` levels
        sampled at `enc_n_points` / `dec_n_points`; with `two_stage`, the proposals' parts (the queries' sources are
        the query groups': query_groups.py); `look_forward_twice`, the decoder's (DeformableTransformerDecoder)."""
        super().__init__()
        d_model, levels = m.hidden_dim, m.num_feature_levels
        self.d_model, self.two_stage = d_model, m.two_stage
        common = dict(d_model=d_model, d_ffn=m.dim_feedforward, dropout=m.dropout, n_levels=levels, n_heads=m.nheads)
        self.encoder = DeformableTransformerEncoder(m.enc_layers, n_points=m.enc_n_points, **common)
        self.decoder = DeformableTransformerDecoder(
            m.dec_layers, look_forward_twice=m.look_forward_twice, n_points=m.dec_n_points, **common
        )
        self.level_embed = mx.random.normal((levels, d_model))
        if m.two_stage:
            self.enc_output = Linear(d_model, d_model)
            self.enc_output_norm = LayerNorm(d_model)
            self.pos_trans = Linear(d_model * 2, d_model * 2)
            self.pos_trans_norm = LayerNorm(d_model * 2)
        else:
            self.reference_points = Linear(d_model, 2)
        self._reset_parameters()

    def _reset_parameters(self):
        """xavier_uniform for every matrix, then MSDeformAttn's own init, as the authors."""
        glorot = nn.init.glorot_uniform()
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight = glorot(module.weight)
            if isinstance(module, MultiheadAttention):
                module.in_proj_weight = glorot(module.in_proj_weight)
        for module in self.modules():
            if isinstance(module, MSDeformAttn):
                module.reset_parameters()
        if not self.two_stage:
            self.reference_points.bias = mx.zeros_like(self.reference_points.bias)

    @staticmethod
    def valid_extent(mask):
        """(B, h, w) padding mask -> (B, 2): unpadded width and height, in pixels of the level."""
        valid_h = (~mask[:, :, 0]).sum(1).astype(mx.float32)
        valid_w = (~mask[:, 0, :]).sum(1).astype(mx.float32)
        return mx.stack([valid_w, valid_h], -1)

    @staticmethod
    def valid_ratios(mask):
        """(B, h, w) padding mask -> (B, 2): unpadded fraction of width and height."""
        _, h, w = mask.shape
        return DeformableTransformer.valid_extent(mask) / mx.array([w, h], dtype=mx.float32)

    def encoder_proposals(self, memory, padding_mask, spatial_shapes):
        """Two-stage: one proposal box per encoder token (its pixel, a level-sized square), in logit
        space (inf where padded or too close to the border), and the memory they are scored from."""
        b = memory.shape[0]
        proposals, start = [], 0
        for level, (h, w) in enumerate(spatial_shapes):
            mask = padding_mask[:, start : start + h * w].reshape(b, h, w)
            grid_y, grid_x = mx.meshgrid(mx.arange(h, dtype=mx.float32), mx.arange(w, dtype=mx.float32), indexing="ij")
            grid = mx.stack([grid_x, grid_y], -1)[None]  # (1, h, w, 2)
            scale = self.valid_extent(mask).reshape(b, 1, 1, 2)
            grid = (grid + 0.5) / scale
            size = mx.full(grid.shape, 0.05 * (2.0**level))
            proposals.append(mx.concatenate([grid, size], -1).reshape(b, -1, 4))
            start += h * w
        proposals = mx.concatenate(proposals, 1)
        valid = mx.all((proposals > 0.01) & (proposals < 0.99), axis=-1, keepdims=True)
        proposals = mx.log(proposals / (1 - proposals))
        invalid = padding_mask[..., None] | ~valid
        proposals = mx.where(invalid, mx.inf, proposals)
        memory = mx.where(invalid, 0.0, memory)
        return self.enc_output_norm(self.enc_output(memory)), proposals

    @staticmethod
    def top_proposals(scores, k: int):
        """(B, K) indices of the `k` highest of `scores` (B, S), highest first: the two-stage queries' proposals."""
        return mx.argsort(-scores, axis=1)[:, :k]

    def proposal_pos_embed(self, proposals, temperature=10000, scale=2 * math.pi):
        """(B, K, 4) proposals in logit space -> (B, K, 2 * d_model) sine embedding (the authors fix
        d_model / 2 = 128 features per coordinate; as Hugging Face, follow d_model)."""
        embedded = sine_embedding(mx.sigmoid(proposals) * scale, self.d_model // 2, temperature)
        return embedded.reshape(*proposals.shape[:2], -1)

    def proposals(self, memory, mask_flatten, spatial_shapes, proposal_heads, count: int):
        """The encoder's proposals scored by `proposal_heads` (class, box) -> (their class logits (B, S, C), their
        box logits (B, S, 4), the `count` best (B, count), best first); the best by the class head's first logit,
        the authors' (DINO's: by its best class)."""
        if count > memory.shape[1]:
            raise ValueError(
                f"two-stage takes its {count} queries from the encoder's proposals, one per feature-map pixel: "
                f"{memory.shape[1]} at {spatial_shapes[0][0] * 8} x {spatial_shapes[0][1] * 8} px; the images must be "
                "larger"
            )
        output_memory, proposals = self.encoder_proposals(memory, mask_flatten, spatial_shapes)
        class_head, box_head = proposal_heads
        enc_class = class_head(output_memory)
        enc_coord = box_head(output_memory) + proposals
        # the ranking is no function to differentiate (DINO gathers through it: its chosen proposals' losses)
        return enc_class, enc_coord, mx.stop_gradient(self.top_proposals(self.proposal_score(enc_class), count))

    @staticmethod
    def proposal_score(enc_class):
        return enc_class[..., 0]

    def encode(self, srcs, masks, pos_embeds):
        """srcs, pos_embeds: per level (B, h, w, d); masks: per level (B, h, w) -> the encoder's memory (B, S, d),
        the flat padding mask (B, S), the levels' (h, w) and valid ratios (B, n_levels, 2)."""
        spatial_shapes = tuple((src.shape[1], src.shape[2]) for src in srcs)
        b, d = srcs[0].shape[0], self.d_model
        src_flatten = mx.concatenate([src.reshape(b, -1, d) for src in srcs], 1)
        mask_flatten = mx.concatenate([mask.reshape(b, -1) for mask in masks], 1)
        pos_flatten = mx.concatenate(
            [pos.reshape(b, -1, d) + self.level_embed[level] for level, pos in enumerate(pos_embeds)], 1
        )
        valid_ratios = mx.stack([self.valid_ratios(mask) for mask in masks], 1)  # (B, n_levels, 2)
        memory = self.encoder(src_flatten, spatial_shapes, valid_ratios, pos_flatten, mask_flatten)
        return memory, mask_flatten, spatial_shapes, valid_ratios

    def __call__(self, srcs, masks, pos_embeds, groups, query_embed=None, proposal_heads=None, refine_heads=None):
        """srcs, pos_embeds: per level (B, h, w, d); masks: per level (B, h, w). `groups`, the query groups that run
        (query_groups.py), say where the decoder's queries come from: learned positions and contents from
        `query_embed` (Q, 2d); positions from the encoder's proposals (two-stage), scored by `proposal_heads` (the
        (class, box) heads), the best Q taken, with contents made from them, or learned in `query_embed` (Q, d)
        (mixed selection). `refine_heads`, one box head per decoder layer, turns on box refinement.

        Returns decoder outputs (n_layers, B, Q, d), initial reference points (B, Q, 2|4), every
        layer's reference points, and for two-stage the encoder's class logits and box logits."""
        memory, mask_flatten, spatial_shapes, valid_ratios = self.encode(srcs, masks, pos_embeds)
        b = memory.shape[0]
        enc_class = enc_coord = None
        if proposed := from_source(groups, PROPOSALS):
            enc_class, enc_coord, top = self.proposals(memory, mask_flatten, spatial_shapes, proposal_heads, proposed)
            top_coords = mx.stop_gradient(mx.take_along_axis(enc_coord, top[..., None], axis=1))
            reference_points = mx.sigmoid(top_coords)
            embedded = to(self.proposal_pos_embed(top_coords), memory.dtype)
            query_pos, tgt = mx.split(self.pos_trans_norm(self.pos_trans(embedded)), 2, -1)
            if from_source(groups, LEARNED, "contents"):  # mixed selection: the proposals give the positions only
                tgt = mx.broadcast_to(query_embed[None], (b, *query_embed.shape)).astype(tgt.dtype)
        else:
            query_pos, tgt = mx.split(query_embed, 2, -1)
            query_pos = mx.broadcast_to(query_pos[None], (b, *query_pos.shape))
            tgt = mx.broadcast_to(tgt[None], (b, *tgt.shape))
            reference_points = widened(mx.sigmoid(self.reference_points(query_pos)))

        hs, references = self.decoder(
            tgt,
            reference_points,
            memory,
            spatial_shapes,
            valid_ratios,
            query_pos,
            mask_flatten,
            refine_heads,
            attention_plan(groups),
        )
        return hs, reference_points, references, enc_class, enc_coord
