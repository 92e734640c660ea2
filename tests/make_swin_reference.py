"""Writes fixtures/swin/: H-Deformable-DETR's own Swin backbone (their models/backbone.py
`TransformerBackbone` around their models/swin_transformer.py) run in PyTorch on a CPU, in float32, eval
mode, with the weights of reference_weights.py's recipe, on two padded images; its outputs, masks and
a few parameters' gradients are what tests/test_swin.py holds the port to.

    python tests/make_swin_reference.py --hdetr /work/hdetr   # a checkout of HDETR/H-Deformable-DETR

Their modules import packages that are not installed (and need not be: nothing of them runs here), so
tiny stand-ins go into sys.modules first:
- timm.models.layers: DropPath, to_2tuple, trunc_normal_ as timm 0.4/0.5 wrote them (DropPath is
  inactive in eval mode; trunc_normal_ only initialises weights the recipe then overwrites);
- mmcv_custom.load_checkpoint and mmdet.utils.get_root_logger: called only to load ImageNet weights
  (init_weights with a path); here init_weights(None), so they raise if ever called;
- torchvision (models, models._utils.IntermediateLayerGetter): imported by their backbone.py and
  util/misc.py for the ResNet branch and helpers that the Swin branch never calls;
- the `models` package itself is registered without running its __init__ (which imports their
  compiled attention op); its backbone.py and swin_transformer.py load from their files as they are.

Weights: for every parameter `name` of their backbone body, recipe_value("backbone.0.body." + name,
shape, seed) (HDETR's checkpoint key); their buffers (relative_position_index) as they compute them.
Their blocks' use_checkpoint (True in TransformerBackbone) is turned off: the numbers are the same,
and torch warns that checkpoint() without use_reentrant will become an error.
"""

import argparse
import importlib
import json
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from reference_weights import recipe_value  # noqa: E402

COMMIT = "f58ceb1165da4b0cd10e9a5a30c7a77fbd33f492"  # HDETR/H-Deformable-DETR, the one this was made with
SEED = 0
SIZES = [[118, 97], [89, 134]]  # (h, w) of each image; the batch is padded to 118 x 134
PREFIX = "backbone.0.body."  # HDETR's checkpoint keys of the backbone body
# The window-12 case: swin_tiny's widths and heads, two blocks a stage (a plain and a shifted one), window 12.
WINDOW12 = dict(embed_dim=96, depths=[2, 2, 2, 2], num_heads=[3, 6, 12, 24], window_size=12)
GRADIENTS = {  # parameters whose gradients are kept, per case
    "tiny": [
        "patch_embed.proj.weight",
        "layers.1.blocks.1.attn.relative_position_bias_table",
        "layers.0.blocks.1.attn.qkv.weight",
        "layers.2.blocks.5.mlp.fc2.bias",
        "layers.3.blocks.1.norm2.weight",
        "norm3.weight",
    ],
    "window12": [
        "patch_embed.proj.weight",
        "layers.2.blocks.1.attn.relative_position_bias_table",
        "norm1.weight",
    ],
}


def install_stand_ins(hdetr: Path):
    import torch

    def module(name, **attributes):
        created = types.ModuleType(name)
        created.__dict__.update(attributes)
        sys.modules[name] = created
        return created

    def drop_path(x, drop_prob=0.0, training=False):  # timm 0.4's
        if drop_prob == 0.0 or not training:
            return x
        keep_prob = 1 - drop_prob
        random_tensor = keep_prob + torch.rand((x.shape[0],) + (1,) * (x.ndim - 1), dtype=x.dtype)
        return x.div(keep_prob) * random_tensor.floor_()

    class DropPath(torch.nn.Module):
        def __init__(self, drop_prob=None):
            super().__init__()
            self.drop_prob = drop_prob

        def forward(self, x):
            return drop_path(x, self.drop_prob, self.training)

    def to_2tuple(x):
        return tuple(x) if isinstance(x, (tuple, list)) else (x, x)

    def trunc_normal_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0):
        return torch.nn.init.trunc_normal_(tensor, mean, std, a, b)

    def never(*args, **kwargs):
        raise RuntimeError("a stand-in: loading ImageNet weights is not part of the reference")

    module("timm")
    module("timm.models")
    module("timm.models.layers", DropPath=DropPath, to_2tuple=to_2tuple, trunc_normal_=trunc_normal_)
    module("mmcv_custom", load_checkpoint=never)
    module("mmdet")
    module("mmdet.utils", get_root_logger=never)
    vision = module("torchvision", __version__="0.0")
    vision.models = module("torchvision.models")
    vision.models._utils = module("torchvision.models._utils", IntermediateLayerGetter=never)
    module("models", __path__=[str(hdetr / "models")])  # the package, without its __init__
    sys.path.insert(0, str(hdetr))  # for their util.misc


def recipe_weights(body, seed: int):
    """Their body's parameters set from the recipe; buffers kept. -> {name: shape} in their order."""
    import torch

    buffers = {name for name, _ in body.named_buffers()}
    shapes = {}
    with torch.no_grad():
        for name, parameter in body.named_parameters():
            parameter.copy_(torch.from_numpy(recipe_value(PREFIX + name, tuple(parameter.shape), seed)))
            shapes[name] = list(parameter.shape)
    return shapes, sorted(buffers)


def images_and_mask(seed: int):
    """Random normal images (already normalised) padded with zeros to the batch's size, as their
    NestedTensor does, and the mask (True on padding)."""
    height, width = (max(size[i] for size in SIZES) for i in (0, 1))
    rng = np.random.default_rng(seed)
    images = np.zeros((len(SIZES), 3, height, width), np.float32)
    mask = np.ones((len(SIZES), height, width), bool)
    for i, (h, w) in enumerate(SIZES):
        images[i, :, :h, :w] = rng.standard_normal((3, h, w), dtype=np.float32)
        mask[i, :h, :w] = False
    return images, mask


def run_case(case: str, backbone, images, mask, seed: int, tensors: dict) -> dict:
    """Their forward (eval, float32) and the gradients of sum(output_i * cotangent_i) over the three
    outputs, cotangent_i = recipe_value("cotangent.<i>", shape, seed)."""
    import torch
    from util.misc import NestedTensor

    body = backbone.body
    for layer in body.layers:
        layer.use_checkpoint = False
    shapes, buffers = recipe_weights(body, seed)
    backbone.eval()
    out = backbone(NestedTensor(torch.from_numpy(images), torch.from_numpy(mask)))
    total = 0
    for name, level in sorted(out.items()):
        features, level_mask = level.decompose()
        cotangent = recipe_value(f"cotangent.{name}", tuple(features.shape), seed)
        total = total + (features * torch.from_numpy(cotangent)).sum()
        tensors[f"{case}.out{name}"] = features.detach().numpy()
        tensors[f"{case}.mask{name}"] = level_mask.numpy().astype(np.uint8)
    total.backward()
    parameters = dict(body.named_parameters())
    for name in GRADIENTS[case]:
        tensors[f"{case}.grad.{name}"] = parameters[name].grad.numpy()
    return {
        "parameters": shapes,
        "buffers": buffers,
        "outputs": sorted(out),
        "gradients": GRADIENTS[case],
        "objective": float(total.detach()),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hdetr", type=Path, required=True, help="a checkout of HDETR/H-Deformable-DETR")
    parser.add_argument("--out", type=Path, default=HERE / "fixtures" / "swin")
    args = parser.parse_args()

    import torch
    from safetensors.numpy import save_file

    torch.manual_seed(SEED)
    warnings.filterwarnings("ignore", message="torch.meshgrid")  # their relative_position_index, as written
    install_stand_ins(args.hdetr.resolve())
    backbone_module = importlib.import_module("models.backbone")
    swin_module = importlib.import_module("models.swin_transformer")
    commit = COMMIT
    try:
        found = subprocess.run(["git", "-C", str(args.hdetr), "rev-parse", "HEAD"], capture_output=True, text=True)
        if found.returncode == 0:
            commit = found.stdout.strip()
    except OSError:
        pass
    if commit != COMMIT:
        print(f"warning: {args.hdetr} is at {commit}, not {COMMIT}", file=sys.stderr)

    images, mask = images_and_mask(SEED)
    tensors = {"images": images, "mask": mask.astype(np.uint8)}
    hdetr_args = argparse.Namespace(drop_path_rate=0.2, pretrained_backbone_path=None)
    cases = {}
    tiny = backbone_module.TransformerBackbone("swin_tiny", True, True, hdetr_args)
    cases["tiny"] = {"backbone": "swin_tiny", **run_case("tiny", tiny, images, mask, SEED, tensors)}
    # their TransformerBackbone around a SwinTransformer built as its branches build theirs, window 12
    window12 = backbone_module.TransformerBackbone("swin_tiny", True, True, hdetr_args)
    window12.body = swin_module.SwinTransformer(
        **WINDOW12, ape=False, drop_path_rate=0.2, patch_norm=True, use_checkpoint=True, out_indices=(1, 2, 3)
    )
    window12.body.init_weights(None)
    cases["window12"] = {"architecture": WINDOW12, **run_case("window12", window12, images, mask, SEED, tensors)}

    args.out.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    save_file(tensors, str(args.out / "reference.safetensors"))
    manifest = {
        "made_by": "tests/make_swin_reference.py: H-Deformable-DETR's TransformerBackbone and SwinTransformer "
        "(their code, timm/mmcv/mmdet/torchvision stand-ins for what it imports but does not use here), "
        "PyTorch on a CPU, float32, eval mode",
        "hdetr_commit": commit,
        "torch": torch.__version__,
        "seed": SEED,
        "sizes": SIZES,
        "weights": 'recipe_value("backbone.0.body." + name, shape, seed) for every parameter of the body '
        "(tests/reference_weights.py); buffers (relative_position_index) are theirs",
        "images": "numpy default_rng(seed).standard_normal per image (3, h, w), float32, zeros on padding; "
        "mask 1 on padding",
        "cotangents": 'out<i> is their output "i" (stage i, (B, C, h, w)); the gradients are of '
        'sum_i sum(out<i> * recipe_value("cotangent.<i>", shape, seed))',
        "drop_path_rate": 0.2,
        "cases": cases,
        "tensors": {k: [list(v.shape), str(v.dtype)] for k, v in tensors.items()},
    }
    text = json.dumps(manifest, indent=1)
    text = re.sub(r"\[[\d,\s]*\]", lambda shape: json.dumps(json.loads(shape[0])), text)  # a shape on one line
    (args.out / "manifest.json").write_text(text + "\n")
    size = (args.out / "reference.safetensors").stat().st_size
    print(f"wrote {args.out / 'reference.safetensors'} ({size / 2**20:.2f} MiB) and manifest.json")


if __name__ == "__main__":
    main()
