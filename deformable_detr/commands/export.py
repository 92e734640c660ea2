"""Export a model: to ONNX, to an MLX function (.mlxfn), to the authors' PyTorch layout or to Hugging Face's.

    deformable-detr export --to torch --checkpoint MODEL.safetensors OUT.pth [--config FILE]
    deformable-detr export --to huggingface --checkpoint MODEL.safetensors DIR [--hf-backbone timm|transformers]
    deformable-detr export --to onnx --checkpoint MODEL.safetensors OUT.onnx [--size H W] [--postprocess]
        [--batch-size N] [--sampler gather|grid_sample]    (deformable_detr/deploy/onnx: the `onnx` extra)
    deformable-detr export --to mlx --checkpoint MODEL.safetensors OUT.mlxfn [--size H W] [--postprocess]
        [--batch-size N]    (deformable_detr/deploy/mlxfn.py: mx.export_function, for mlx-c / mlx-swift)

(also `python -m deformable_detr.export`; each takes --raw-weights and config overrides `section.key=value`
after OUT, as every command that loads a model; `export MODEL OUT`, the old spelling, works one release more).

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
and checks that every tensor comes back unchanged. A DINO model's (model.architecture dino) OUT is DINO's
main.py checkpoint: its names, the shared heads under every layer's, and the args its build_dino reads;
`--to huggingface` refuses it (transformers has no DINO). Needs PyTorch (the `convert` extra).
Built on `Detector.export`.
"""

from pathlib import Path

from ..errors import UsageError, entry_point
from .cli import add_model_arguments, command_parser, load_detector, note_old_spelling, split_overrides


def build_parser(old_spelling: bool = False):
    """export's parser (docs/commands.md is generated from it); with `old_spelling`, --checkpoint is not
    required (`export SRC DST`, parse_args)."""
    parser = command_parser("export", __doc__)
    parser.add_argument(
        "--to", choices=["torch", "huggingface", "onnx", "mlx"], required=True, help="the target layout"
    )
    parser.add_argument(
        "dst", metavar="OUT", help="the .pth (torch), .onnx or .mlxfn file to write, or the folder (huggingface)"
    )
    # no --precision: the files hold float32 weights and graphs
    add_model_arguments(parser, checkpoint_required=not old_spelling)
    parser.add_argument(
        "--hf-backbone",
        choices=["timm", "transformers"],
        default="timm",
        help="huggingface: the ResNet under timm's names as the Hub's SenseTime models (from_pretrained needs timm), "
        "or transformers' own ResNet (any width; no DC5)",
    )
    parser.add_argument(
        "--size", type=int, nargs=2, metavar=("H", "W"), help="onnx, mlx: the canvas (default: val_size x max_size)"
    )
    parser.add_argument("--batch-size", type=int, default=1, help="onnx, mlx: images a run (the file's static batch)")
    parser.add_argument(
        "--postprocess",
        action="store_true",
        help="onnx, mlx: take target_sizes, return the scores, labels, boxes of the best evaluation.top_k (query, "
        "class) pairs (100; DINO's configs 300)",
    )
    parser.add_argument(
        "--sampler", choices=["gather", "grid_sample"], default="gather", help="onnx: the attention's bilinear sampler"
    )
    return parser


def parse_args(argv=None):
    """export's arguments; `export SRC DST` (the weights positional, before --checkpoint) as
    `export --checkpoint SRC DST`, with its note."""
    try:
        args = build_parser().parse_intermixed_args(argv)  # overrides before and after the options
    except UsageError:
        args = build_parser(old_spelling=True).parse_intermixed_args(argv)  # a usage error as the other's
        if args.checkpoint is not None or not args.overrides or "=" in args.overrides[0]:
            raise
        note_old_spelling("export SRC DST")
        args.checkpoint, args.dst = args.dst, args.overrides.pop(0)
    args.overrides, args.dst = split_overrides(args.overrides)[0], Path(args.dst)
    return args


@entry_point
def main(argv=None):
    args = parse_args(argv)
    canvas = dict(size=args.size, batch_size=args.batch_size, postprocess=args.postprocess)
    if args.to not in ("onnx", "mlx") and (args.size or args.postprocess or args.batch_size != 1):
        raise UsageError(f"--size, --batch-size and --postprocess are for --to onnx or mlx, not --to {args.to}")
    if args.to != "onnx" and args.sampler != "gather":
        why = " (an .mlxfn file samples with MLX's gathers)" if args.to == "mlx" else ""
        raise UsageError(f"--sampler is for --to onnx, not --to {args.to}{why}")
    if args.to != "huggingface" and args.hf_backbone != "timm":
        raise UsageError(f"--hf-backbone is for --to huggingface, not --to {args.to}")
    detector = load_detector(args)
    options = {"hf_backbone": args.hf_backbone} if args.to == "huggingface" else {}
    options = {**canvas, "sampler": args.sampler} if args.to == "onnx" else canvas if args.to == "mlx" else options
    print(detector.export(args.to, args.dst, **options))


if __name__ == "__main__":
    main()
