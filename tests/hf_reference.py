"""Hugging Face's `DeformableDetrForObjectDetection` as a test reference: a small model of each
variant with every weight moved off its initial value (zeros and ones could hide a mapping error).
Import it inside tests that have skipped without transformers."""

import torch
import transformers

VARIANTS = {  # name -> (with_box_refine, two_stage, num_feature_levels)
    "base": (False, False, 4),
    "single_scale": (False, False, 1),
    "refine": (True, False, 4),  # transformers 5 writes its class heads once
    "refine+two_stage": (True, True, 4),
}


def huggingface_model(variant: str, labels: dict | None = None, seed: int = 0):
    """`labels`: id2label ({id: name}); default 7 unnamed classes."""
    refine, two_stage, levels = VARIANTS[variant]
    torch.manual_seed(seed)
    names = {"id2label": labels, "label2id": {v: k for k, v in labels.items()}} if labels else {"num_labels": 7}
    config = transformers.DeformableDetrConfig(
        use_timm_backbone=False,
        use_pretrained_backbone=False,
        backbone_config=transformers.ResNetConfig(
            out_features=["stage4"] if levels == 1 else ["stage2", "stage3", "stage4"]
        ),
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        num_feature_levels=levels,
        num_queries=20,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        with_box_refine=refine,
        two_stage=two_stage,
        two_stage_num_proposals=20,
        **names,
    )
    hf = transformers.DeformableDetrForObjectDetection(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
        for name, b in hf.named_buffers():
            if name.endswith(("running_var", "running_mean")):
                b.copy_(torch.rand_like(b) + 0.5 if name.endswith("var") else torch.randn_like(b) * 0.1)
    return hf
