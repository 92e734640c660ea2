"""Small models of every variant with their weights moved off init, padded batches and checkpoints:
what the exporters' tests (ONNX, .mlxfn) run their files on."""

from deformable_detr import build_model, load_config
from deformable_detr.config import CONFIGS_DIR

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

CANVAS = (96, 128)
SIZES = ((72, 100), (90, 60), (50, 50))  # landscape, portrait, square: padding below and to the right of each
VARIANTS = ["r50", "r50_single_scale", "r50_single_scale_dc5", "r50_box_refine", "r50_two_stage", "hdetr_r50_12ep"]
DINO_VARIANTS = ["dino_r50_4scale_12ep", "dino_r50_5scale_12ep"]  # 4 levels; 5 with the stride-4 map
SMALL = [
    *("model.backbone=resnet18", "model.backbone_width=16", "model.hidden_dim=64", "model.nheads=4"),
    *("model.enc_layers=2", "model.dec_layers=2", "model.dim_feedforward=64", "model.num_queries=12"),
    *("model.num_classes=5", "model.enc_n_points=2", "model.dec_n_points=3", "model.dropout=0.0"),
]


def small_model(variant: str, padding_proposals_low: bool = True, seed: int = 0, extra: tuple = ()):
    """A small model of the variant, every weight off its init: normal noise (0.1) on every
    parameter, frozen batch norm's variances in [0.5, 1.5]. Two-stage: where `padding_proposals_low`,
    the proposals of padding (whose memory is zeroed, so all alike) score below the image's, as a
    trained model's do; else random weights pick them first. `extra`: overrides after SMALL's."""
    cfg = load_config(CONFIGS_DIR / f"{variant}.yaml", [*SMALL, *extra])
    mx.random.seed(seed)
    model = build_model(cfg)
    model.eval()
    rng = np.random.default_rng(seed)
    moved = []
    for key, value in tree_flatten(model.parameters()):
        value = np.array(value)
        value = (
            rng.uniform(0.5, 1.5, value.shape)
            if key.endswith("running_var")
            else value + rng.normal(0, 0.1, value.shape)
        )
        moved.append((key, mx.array(value.astype(np.float32))))
    model.load_weights(moved)
    if cfg.model.two_stage and padding_proposals_low:  # the zeroed memory's LayerNorm output against the ranking's
        params = dict(tree_flatten(model.parameters()))
        row = np.array(params["transformer.enc_output_norm.weight"]) * ranking_row(cfg.model, params)
        model.load_weights([("transformer.enc_output.bias", mx.array(-row / np.linalg.norm(row)))], strict=False)
    return model, cfg


def ranking_row(m, params: dict) -> np.ndarray:
    """What the two-stage ranking scores a proposal's memory by: class 0's row of the proposal class head (the
    authors'), or every class's row of the encoder's own head summed (DINO's, which ranks by the best class)."""
    if m.architecture == "dino":
        return np.array(params["transformer.enc_out_class_embed.weight"]).sum(0)
    return np.array(params["class_embed.2.weight"])[0]


def weights_of(model) -> dict:
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


def padded_batch(seed: int = 1):
    """Three images of SIZES on the canvas -> (images (3, H, W, 3), mask (3, H, W) True on padding)."""
    rng = np.random.default_rng(seed)
    images = np.zeros((len(SIZES), *CANVAS, 3), np.float32)
    mask = np.ones((len(SIZES), *CANVAS), bool)
    for i, (h, w) in enumerate(SIZES):
        images[i, :h, :w] = rng.standard_normal((h, w, 3))
        mask[i, :h, :w] = False
    return images, mask


def assert_close(ours, theirs, what):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape, what
    difference = np.abs(ours - theirs).max() / np.abs(ours).max()
    assert difference <= 1e-4, f"{what}: {difference:.2e} of the largest value"


def small_checkpoint(tmp_path, variant="r50_two_stage", extra: tuple = ()):
    from deformable_detr.training.optimizer import build_optimizer
    from deformable_detr.weights.checkpoint import save_checkpoint

    model, cfg = small_model(variant, extra=extra)
    path = tmp_path / "checkpoint.safetensors"
    save_checkpoint(path, model, build_optimizer(cfg), cfg, {"epoch": 1, "step": 1, "global_step": 1}, {1: "thing"})
    return path, model


def assert_post_processed(model, inputs: dict, target_sizes, exported: tuple):
    """An exported --postprocess graph's (scores, labels, boxes) on the canvas inputs against
    post_process of our model's outputs on the same inputs, image by image."""
    from deformable_detr.models import post_process

    scores, labels, boxes = exported
    images = mx.array(inputs["pixel_values"].transpose(0, 2, 3, 1))
    ours = post_process(model(images, mx.array(inputs["pixel_mask"] == 0)), target_sizes.tolist())
    assert scores.shape == (3, 12 * 5) and labels.dtype == np.int64  # all 60 (query, class) pairs, < 100
    for i, detections in enumerate(ours):
        assert_close(detections["scores"], scores[i], "scores")
        np.testing.assert_array_equal(np.array(detections["labels"]), labels[i])
        assert_close(detections["boxes"], boxes[i], "boxes in pixels")
