"""`DINO`: DETR with Improved deNoising anchOr boxes (github.com/IDEA-Research/DINO, models/dino/), as its code builds
it: Deformable DETR two-stage with box refinement, mixed selection (its embed_init_tgt) and look forward twice, and
- query positions made at every decoder layer from its reference boxes: a sine embedding of the 4-D box (y, x, w, h),
  through `ref_point_head` (its deformable decoder's conditional queries);
- a LayerNorm on the decoder's outputs (`decoder.norm`), the next layer's box refined from the output before it;
- one class head and one box head shared by the decoder layers (`class_embed.0`, `bbox_embed.0`: its
  dec_pred_*_embed_share; model.decoder_heads per_layer: one of each per layer, detrex's), the encoder's proposals
  scored by heads of their own (`transformer.enc_out_*`), chosen by their best class and matched by class (its
  `interm_outputs`, our `enc_outputs`: the chosen proposals only);
- the position encoding without the half-pixel offset (its PositionEmbeddingSineHW: model.position_offset 0),
  temperature 20 in its configs (detrex's DINO: the authors' encoding);
- contrastive denoising queries in training (models/denoising.py, the query group `denoising`), their labels
  embedded by `label_enc`.
Parameter names are DINO's state_dict's without its tied copies of the shared heads."""

import mlx.core as mx
import mlx.nn as nn

from ..config import ModelConfig
from .backbone_base import BackboneBase
from .combinations import check_model
from .deformable_detr import MLP, ClassHead, DeformableDETR
from .deformable_transformer import (
    DeformableTransformer,
    DeformableTransformerDecoder,
    DeformableTransformerEncoder,
    MultiheadAttention,
    inverse_sigmoid,
)
from .denoising import DINO_EPS, DenoisingQueries
from .linear import Linear
from .ms_deform_attn import MSDeformAttn
from .position_encoding import sine_embedding
from .precision import LayerNorm, to
from .query_groups import PROPOSALS, attention_plan, from_source, query_groups, running, spans
from .recompute import checkpointed


def box_sine_embedding(boxes: mx.array, num_feats: int) -> mx.array:
    """(B, Q, 4) boxes cx, cy, w, h in [0, 1] -> (B, Q, 4 num_feats): DINO's gen_sineembed_for_position, the
    coordinates in its order y, x, w, h, each times 2 pi, temperature 10000."""
    scale = 2 * 3.141592653589793
    order = (1, 0, 2, 3)
    return mx.concatenate([sine_embedding(boxes[..., i] * scale, num_feats, 10000) for i in order], -1)


class DINODecoder(DeformableTransformerDecoder):
    """DINO's deformable decoder: each layer's query positions from its reference boxes (`ref_point_head` over
    their sine embedding, at the first level's valid ratio), its outputs normed (`norm`), the next layer's boxes
    refined by the shared box head from the output before the norm; each layer's boxes are returned with their
    gradient (look forward twice), the next layer samples at them without."""

    def __init__(self, num_layers: int, **layer_args):
        super().__init__(num_layers, look_forward_twice=True, **layer_args)
        d_model = layer_args["d_model"]
        self.ref_point_head = MLP(2 * d_model, d_model, d_model, 2)
        self.norm = LayerNorm(d_model)

    def __call__(self, tgt, reference_points, src, spatial_shapes, valid_ratios, padding_mask, box_heads, plan=None):
        """tgt (B, Q, d), reference_points (B, Q, 4) in [0, 1] -> every layer's normed output (n_layers, B, Q, d) and
        refined boxes (n_layers, B, Q, 4); `box_heads`: one shared, or one per layer."""
        d_model = tgt.shape[-1]
        ratios = mx.concatenate([valid_ratios, valid_ratios], -1)[:, None]  # (B, 1, n_levels, 4)
        outputs, references = [], []
        for lid, layer in enumerate(self.layers):
            points = reference_points[:, :, None] * ratios
            query_pos = self.ref_point_head(box_sine_embedding(points[:, :, 0], d_model // 2))
            tgt = checkpointed(
                [layer],
                lambda tgt, pos, points, src, layer=layer: layer(
                    tgt, pos, points, src, spatial_shapes, padding_mask, plan
                ),
                tgt,
                to(query_pos, tgt.dtype),
                points,
                src,
                enabled=self.activation_checkpointing,
            )
            box_head = box_heads[lid] if len(box_heads) > 1 else box_heads[0]
            refined = mx.sigmoid(box_head(tgt) + inverse_sigmoid(reference_points, DINO_EPS))
            reference_points = mx.stop_gradient(refined)
            outputs.append(self.norm(tgt))
            references.append(refined)
        return mx.stack(outputs), mx.stack(references)


class DINOTransformer(DeformableTransformer):
    """DINO's deformable transformer (its `standard` two-stage): the authors' encoder, the encoder's proposals
    scored by `enc_out_class_embed` / `enc_out_bbox_embed` and the best `num_queries` by any class taken as the
    queries' boxes, their contents learned (`tgt_embed`); DINODecoder."""

    def __init__(self, m: ModelConfig):
        nn.Module.__init__(self)
        d_model, levels = m.hidden_dim, m.num_feature_levels
        self.d_model, self.two_stage = d_model, True
        common = dict(d_model=d_model, d_ffn=m.dim_feedforward, dropout=m.dropout, n_levels=levels, n_heads=m.nheads)
        self.encoder = DeformableTransformerEncoder(m.enc_layers, n_points=m.enc_n_points, **common)
        self.decoder = DINODecoder(m.dec_layers, n_points=m.dec_n_points, **common)
        self.level_embed = mx.random.normal((levels, d_model))
        self.tgt_embed = nn.Embedding(m.num_queries, d_model)
        self.enc_output = Linear(d_model, d_model)
        self.enc_output_norm = LayerNorm(d_model)
        self.enc_out_class_embed = ClassHead(d_model, m.num_classes)
        self.enc_out_bbox_embed = MLP(d_model, d_model, 4, 3)
        glorot = nn.init.glorot_uniform()
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight = glorot(module.weight)
            if isinstance(module, MultiheadAttention):
                module.in_proj_weight = glorot(module.in_proj_weight)
        for module in self.modules():
            if isinstance(module, MSDeformAttn):
                module.reset_parameters()

    @staticmethod
    def proposal_score(enc_class):
        return enc_class.max(-1)  # DINO's: a proposal's best class

    def __call__(self, srcs, masks, pos_embeds, groups, box_heads, denoising=None):
        """srcs, pos_embeds: per level (B, h, w, d); masks: per level (B, h, w); `groups` the query groups that run,
        the detector's first; `box_heads` the decoder's (one shared, or one per layer); `denoising`: the denoising
        group's contents (B, N, d), positions (B, N, 4) in logit space and attention mask (N, N), where it runs.

        Returns every decoder layer's outputs (n_layers, B, Q, d), the initial boxes (B, Q, 4), every layer's refined
        boxes, and the chosen proposals' predictions (`pred_logits`, `pred_boxes`: DINO's interm_outputs)."""
        memory, mask_flatten, spatial_shapes, valid_ratios = self.encode(srcs, masks, pos_embeds)
        b = memory.shape[0]
        count = from_source(groups, PROPOSALS)
        heads = (self.enc_out_class_embed, self.enc_out_bbox_embed)
        enc_class, enc_coord, top = self.proposals(memory, mask_flatten, spatial_shapes, heads, count)
        top_coords = mx.take_along_axis(enc_coord, top[..., None], axis=1)
        chosen = {
            "pred_logits": mx.take_along_axis(enc_class, top[..., None], axis=1),
            "pred_boxes": mx.sigmoid(top_coords),
        }
        tgt = mx.broadcast_to(self.tgt_embed.weight[None], (b, *self.tgt_embed.weight.shape)).astype(memory.dtype)
        reference_points = mx.sigmoid(mx.stop_gradient(top_coords))
        masks = {}
        if denoising is not None:
            contents, positions, mask = denoising
            tgt = mx.concatenate([tgt, contents.astype(tgt.dtype)], 1)
            reference_points = mx.concatenate([reference_points, mx.sigmoid(positions)], 1)
            masks["denoising"] = mx.concatenate([mask, mx.zeros((mask.shape[0], count), mask.dtype)], 1)
        hs, references = self.decoder(
            tgt,
            reference_points,
            memory,
            spatial_shapes,
            valid_ratios,
            mask_flatten,
            box_heads,
            attention_plan(groups, masks),
        )
        return hs, reference_points, references, chosen


class DINO(DeformableDETR):
    """images (B, H, W, 3) normalised, mask (B, H, W) True on padding[, denoising: the batch's DenoisingQueries in
    training] -> the outputs of DeformableDETR (the detector's queries' `pred_logits`, `pred_boxes`, `aux_outputs`,
    `enc_outputs` the chosen proposals'), and in training with `denoising` the denoising queries' under `denoising`.
    `m`: the config's model section (architecture dino; combinations.py says what goes with it)."""

    def __init__(self, backbone: BackboneBase, transformer: DINOTransformer, m: ModelConfig):
        nn.Module.__init__(self)
        check_model(m)
        hidden_dim = transformer.d_model
        self.groups = query_groups(m)
        self.num_queries, self.num_feature_levels = m.num_queries, m.num_feature_levels
        self.aux_loss, self.with_box_refine, self.two_stage = m.aux_loss, True, True
        self.backbone = [backbone]
        self.position_embedding = self.position_encoding(m)
        self.transformer = transformer
        heads = m.dec_layers if m.decoder_heads == "per_layer" else 1
        self.class_embed = [ClassHead(hidden_dim, m.num_classes) for _ in range(heads)]
        self.bbox_embed = [MLP(hidden_dim, hidden_dim, 4, 3) for _ in range(heads)]
        labelbook = m.num_classes if m.dn_labelbook_size == "auto" else m.dn_labelbook_size
        self.label_enc = nn.Embedding(labelbook + 1, hidden_dim)
        self.input_proj = self.input_projections(backbone.num_channels, hidden_dim, m.num_feature_levels)
        self._reset_parameters()

    def _reset_parameters(self):
        super()._reset_parameters()  # and the encoder's heads as the decoder's: DINO's start as copies of them
        encoder_class, encoder_box = self.transformer.enc_out_class_embed, self.transformer.enc_out_bbox_embed
        encoder_class.bias = mx.array(self.class_embed[0].bias)
        encoder_box.layers[-1].weight = mx.zeros_like(encoder_box.layers[-1].weight)
        encoder_box.layers[-1].bias = mx.zeros_like(encoder_box.layers[-1].bias)

    def __call__(self, images: mx.array, mask: mx.array, denoising: DenoisingQueries | None = None) -> dict:
        groups = running(self.groups, self.training, denoising is not None)
        noised = None
        if "denoising" in spans(groups):
            labels = mx.array(denoising.labels)
            embedded = self.label_enc.weight[mx.maximum(labels, 0)]
            contents = mx.where((labels >= 0)[..., None], embedded, mx.zeros((), embedded.dtype))
            noised = (contents, mx.array(denoising.positions), mx.array(denoising.attention_mask))
        hs, init_reference, references, chosen = self.transformer(
            *self.features(images, mask), groups, self.bbox_embed, noised
        )
        outputs = []
        for layer in range(hs.shape[0]):
            reference = init_reference if layer == 0 else references[layer - 1]
            boxes = mx.sigmoid(self.head(self.bbox_embed, layer)(hs[layer]) + inverse_sigmoid(reference, DINO_EPS))
            outputs.append({"pred_logits": self.head(self.class_embed, layer)(hs[layer]), "pred_boxes": boxes})
        out = self.group_predictions(outputs, groups)
        out["enc_outputs"] = chosen
        return out
