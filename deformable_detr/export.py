"""Export this port's weights to the authors' PyTorch layout or to Hugging Face transformers'.

    python -m deformable_detr.export --to torch MODEL.safetensors OUT.pth [--config FILE]
    python -m deformable_detr.export --to huggingface MODEL.safetensors DIR [--hf-backbone timm|transformers]

`--to huggingface` writes DIR/config.json (the variant, `id2label` from the category names),
preprocessor_config.json (the resize and normalisation) and model.safetensors in the layout of the
Hub's SenseTime checkpoints, for `DeformableDetrForObjectDetection.from_pretrained(DIR)` and
transformers' pipelines; checked, as below, to convert back unchanged.

MODEL is converted weights (`deformable_detr.convert`) or a training checkpoint (`train.py`). OUT
is `{"model": state_dict, "args": Namespace}` as the authors' `main.py` saves it: their key names,
convolutions OIHW, and the tied keys restored (without box refinement one `class_embed` /
`bbox_embed` repeated for every decoder layer; the decoder's references to the top-level heads with
refinement or two-stage). `args` holds the model options the keys cannot show (heads, points, DC5),
from the checkpoint's config or `--config`. Before writing, the export converts its own result back
and checks that every tensor comes back unchanged. Needs PyTorch (`pip install -e ".[convert]"`).
Built on `Detector.export`.
"""

from pathlib import Path

from .cli import ArgumentParser, entry_point
from .inference.detector import Detector


@entry_point
def main(argv=None):
    parser = ArgumentParser(prog="python -m deformable_detr.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--to", choices=["torch", "huggingface"], required=True, help="the target layout")
    parser.add_argument("src", help="converted weights or a training checkpoint (.safetensors), or hf://ORG/NAME")
    parser.add_argument("dst", type=Path, help="the .pth file to write (torch), or the folder (huggingface)")
    parser.add_argument("--config", type=Path, help="the model's config, where the weights do not record it")
    parser.add_argument(
        "--hf-backbone",
        choices=["timm", "transformers"],
        default="timm",
        help="huggingface: the ResNet under timm's names as the Hub's SenseTime models (from_pretrained needs timm), "
        "or transformers' own ResNet (any width; no DC5)",
    )
    parser.add_argument(
        "--raw-weights", action="store_true", help="the trained weights, not their EMA (where the file has one)"
    )
    args = parser.parse_args(argv)
    detector = Detector.load(args.src, args.config, raw_weights=args.raw_weights)
    print(detector.export(args.to, args.dst, hf_backbone=args.hf_backbone))


if __name__ == "__main__":
    main()
