"""Convert PyTorch Deformable DETR weights to this port's safetensors.

    python -m deformable_detr.convert SRC DST.safetensors [--backbone-only]

SRC is one of
- the authors' checkpoint (`.pth`: a dict with `model`, as released, usually also `args`,
  `optimizer`, `epoch`; or a bare state_dict); H-Deformable-DETR's likewise;
- DINO's (IDEA-Research/DINO's main.py `.pth`: `model` and `args`, which say its 4 or 5 scales, its
  denoising label book and its shared heads; detrex's DINO read by its own key names), recorded with the
  configs/dino_*.yaml recipe it matches; what is not built (DINO's masks, ConvNeXt) refused in one line;
- Hugging Face `DeformableDetrForObjectDetection` weights (`model.safetensors` or
  `pytorch_model.bin`, or the folder holding one, of any transformers release), or
  `hf://ORG/NAME[@REVISION]` on the Hub;
- with `--backbone-only`, ImageNet weights: torchvision's ResNets (`resnet50-*.pth`), Swin Transformers in
  Microsoft's release layout (`swin_tiny_patch4_window7_224.pth`, H-Deformable-DETR's) or timm's, written as a
  backbone-only file that training starts from (`train.py --weights`).

Every key is mapped or refused: an unknown or missing key is an error naming it. Tied keys (the
authors repeat a shared head under several names) are checked equal and stored once. `.pth` files
are read with `torch.load(weights_only=True)`, allowing only `argparse.Namespace` beyond tensors.
torch is needed only for `.pth` / `.bin` input (the `convert` extra).
"""

from pathlib import Path

from ..errors import entry_point
from ..weights.conversion import convert, save_converted
from ..weights.hub import is_hub, snapshot
from .cli import command_parser


def build_parser():
    """convert's parser (docs/commands.md is generated from it)."""
    parser = command_parser("convert", __doc__)
    parser.add_argument(
        "src",
        help="the authors' .pth (H-Deformable-DETR's, DINO's main.py's or detrex's DINO too), Hugging Face weights "
        "(file or folder, or hf://ORG/NAME[@REVISION] on the Hub), "
        "or ImageNet weights (torchvision ResNet, Microsoft or timm Swin) with --backbone-only",
    )
    parser.add_argument("dst", type=Path, help="the .safetensors file to write")
    parser.add_argument(
        "--backbone-only",
        action="store_true",
        help="convert ImageNet weights: torchvision ResNets, Swin (Microsoft's or timm's layout)",
    )
    parser.add_argument(
        "--dilation",
        action="store_true",
        help="the checkpoint is DC5 (not visible in its keys when the checkpoint has no args)",
    )
    return parser


@entry_point
def main(argv=None):
    args = build_parser().parse_args(argv)
    src = snapshot(args.src) if is_hub(args.src) else Path(args.src)
    weights, options, message = convert(src, backbone_only=args.backbone_only, dilation=args.dilation, source=args.src)
    names, where = save_converted(args.dst, weights, options, src)
    print(message)
    if names:
        print(f"category names: {where} (recorded in the file)")
    print(f"wrote {len(weights)} tensors to {args.dst}")


if __name__ == "__main__":
    main()
