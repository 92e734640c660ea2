"""Writes fixtures/dino_backbone/: DINO's own Swin backbone as its 5-scale configs build it (return_interm_indices
[0, 1, 2, 3]: stage 0's map too, with its own norm0), run in PyTorch on a CPU, float32, eval mode, with the weights
of reference_weights.py's recipe, on two small padded images: its four maps, their masks and a few parameters'
gradients; and the names DINO's code gives what tests/test_dino_backbone.py maps to ours.

    git clone https://github.com/IDEA-Research/DINO /tmp/dino   # at tests/dino_code.py's DINO_COMMIT
    python tests/make_dino_backbone_reference.py --dino /tmp/dino

Their code is imported as tests/dino_code.py imports it (its stand-ins for torchvision, timm and their CUDA op).
The backbones are built by their build_backbone from config/DINO/DINO_5scale.py's args (backbone swin_T_224_1k,
and its own resnet50); the model's `backbone` is that Joiner, so their state_dict keys are `backbone.` + the
Joiner's. Stochastic depth (their default drop_path_rate 0.2) is inactive in eval mode.

Recorded:
- `swin_tiny_5scale`: every key and shape of the Swin Joiner's state (parameters and the relative_position_index
  buffers), the outputs out<i> (stage i, (B, C, h, w)) and masks mask<i> of their SwinTransformer.forward, and
  the gradients of sum_i sum(out<i> * recipe_value("cotangent.<i>", shape, seed)) for GRADIENTS;
- `resnet50_5scale`: every key and shape of the ResNet Joiner's state (no outputs: the ResNet is the authors');
- `architectures`: for each of their Swin names, the arguments their build_swin_transformer gives their
  SwinTransformer (by a recorder put in its place while it is called) with the pretrain_img_size their
  build_backbone reads from the name.
"""

import argparse
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from reference_weights import recipe_value  # noqa: E402

SEED = 0
SIZES = [[45, 38], [29, 52]]  # (h, w) of each image; the batch is padded to 45 x 52: stage 0 is 12 x 13
GRADIENTS = [
    "0.patch_embed.proj.weight",
    "0.norm0.weight",
    "0.norm0.bias",
    "0.layers.0.blocks.1.attn.relative_position_bias_table",
    "0.layers.3.blocks.1.mlp.fc2.bias",
]
DINO_SWINS = ("swin_T_224_1k", "swin_B_224_22k", "swin_B_384_22k", "swin_L_224_22k", "swin_L_384_22k")


def images_and_mask(seed: int):
    """Random normal images (already normalised) padded with zeros to the batch's size, as their NestedTensor
    does, and the mask (True on padding)."""
    height, width = (max(size[i] for size in SIZES) for i in (0, 1))
    rng = np.random.default_rng(seed)
    images = np.zeros((len(SIZES), 3, height, width), np.float32)
    mask = np.ones((len(SIZES), height, width), bool)
    for i, (h, w) in enumerate(SIZES):
        images[i, :, :h, :w] = rng.standard_normal((3, h, w), dtype=np.float32)
        mask[i, :h, :w] = False
    return images, mask


def state_shapes(joiner) -> dict:
    return {"backbone." + k: list(v.shape) for k, v in joiner.state_dict().items()}


def architectures(swin_module) -> dict:
    """Their build_swin_transformer's arguments to SwinTransformer for each of their Swin names."""
    built = swin_module.SwinTransformer
    swin_module.SwinTransformer = lambda **kwargs: kwargs
    try:
        found = {}
        for name in DINO_SWINS:
            kwargs = swin_module.build_swin_transformer(name, pretrain_img_size=int(name.split("_")[-2]))
            found[name] = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in kwargs.items()}
        return found
    finally:
        swin_module.SwinTransformer = built


def run_swin(joiner, images, mask, tensors: dict) -> dict:
    import torch
    from util.misc import NestedTensor

    with torch.no_grad():
        for name, parameter in joiner.named_parameters():
            parameter.copy_(torch.from_numpy(recipe_value("backbone." + name, tuple(parameter.shape), SEED)))
    joiner.eval()
    out = joiner[0](NestedTensor(torch.from_numpy(images), torch.from_numpy(mask)))
    total = 0
    for i, level in sorted(out.items()):
        features, level_mask = level.decompose()
        cotangent = recipe_value(f"cotangent.{i}", tuple(features.shape), SEED)
        total = total + (features * torch.from_numpy(cotangent)).sum()
        tensors[f"out{i}"] = features.detach().numpy()
        tensors[f"mask{i}"] = level_mask.numpy().astype(np.uint8)
    total.backward()
    parameters = dict(joiner.named_parameters())
    for name in GRADIENTS:
        tensors[f"grad.{name}"] = parameters[name].grad.numpy()
    return {"outputs": sorted(out), "gradients": GRADIENTS, "objective": float(total.detach())}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dino", type=Path, required=True, help="a checkout of IDEA-Research/DINO")
    parser.add_argument("--out", type=Path, default=HERE / "fixtures" / "dino_backbone")
    args = parser.parse_args()

    import torch
    from dino_code import DINO_COMMIT, dino_args, import_dino
    from safetensors.numpy import save_file

    torch.manual_seed(SEED)
    warnings.filterwarnings("ignore", message="torch.meshgrid")  # their relative_position_index, as written
    models = import_dino(args.dino)
    from models.dino import backbone as backbone_module
    from models.dino import swin_transformer as swin_module

    commit = DINO_COMMIT
    found = subprocess.run(["git", "-C", str(args.dino), "rev-parse", "HEAD"], capture_output=True, text=True)
    if found.returncode == 0:
        commit = found.stdout.strip()
    if commit != DINO_COMMIT:
        print(f"warning: {args.dino} is at {commit}, not {DINO_COMMIT}", file=sys.stderr)

    images, mask = images_and_mask(SEED)
    tensors = {"images": images, "mask": mask.astype(np.uint8)}
    swin_args = dino_args(models, "DINO_5scale.py", backbone="swin_T_224_1k")
    swin = backbone_module.build_backbone(swin_args)
    cases = {
        "swin_tiny_5scale": {
            "dino_backbone": swin_args.backbone,
            "return_interm_indices": swin_args.return_interm_indices,
            "num_channels": swin.num_channels,
            "state_dict": state_shapes(swin),
            **run_swin(swin, images, mask, tensors),
        }
    }
    resnet_args = dino_args(models, "DINO_5scale.py")
    resnet = backbone_module.build_backbone(resnet_args)
    cases["resnet50_5scale"] = {
        "dino_backbone": resnet_args.backbone,
        "return_interm_indices": resnet_args.return_interm_indices,
        "num_channels": resnet.num_channels,
        "state_dict": state_shapes(resnet),
    }

    args.out.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    save_file(tensors, str(args.out / "reference.safetensors"))
    manifest = {
        "made_by": "tests/make_dino_backbone_reference.py: DINO's build_backbone (models/dino/backbone.py, "
        "swin_transformer.py) from config/DINO/DINO_5scale.py's args, their code with tests/dino_code.py's "
        "stand-ins, PyTorch on a CPU, float32, eval mode",
        "dino_commit": commit,
        "torch": torch.__version__,
        "seed": SEED,
        "sizes": SIZES,
        "weights": 'recipe_value("backbone." + name, shape, seed) for every parameter of their Joiner (tests/'
        "reference_weights.py): their key names; buffers (relative_position_index) are theirs",
        "images": "numpy default_rng(seed).standard_normal per image (3, h, w), float32, zeros on padding; "
        "mask 1 on padding",
        "cotangents": "out<i> is their output i (stage i, (B, C, h, w)); the gradients (grad.<their Joiner key>) "
        'are of sum_i sum(out<i> * recipe_value("cotangent.<i>", shape, seed))',
        "cases": cases,
        "architectures": architectures(swin_module),
        "tensors": {k: [list(v.shape), str(v.dtype)] for k, v in tensors.items()},
    }
    text = json.dumps(manifest, indent=1)
    text = re.sub(r"\[[\d,\s]*\]", lambda shape: json.dumps(json.loads(shape[0])), text)  # a shape on one line
    (args.out / "manifest.json").write_text(text + "\n")
    size = (args.out / "reference.safetensors").stat().st_size
    print(f"wrote {args.out / 'reference.safetensors'} ({size / 2**10:.0f} KiB) and manifest.json")


if __name__ == "__main__":
    main()
