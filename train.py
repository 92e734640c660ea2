"""Train Deformable DETR: `deformable_detr/commands/train.py` (also `deformable-detr train`,
`python -m deformable_detr.train`).

python train.py --config configs/r50.yaml [--output-dir DIR] [--resume [CKPT] | --overwrite]
                [--eval-only] [--weights W | --finetune W] [section.key=value ...]
"""

from deformable_detr.commands.train import main, parse_args  # noqa: F401  (parse_args: for the tests)

if __name__ == "__main__":
    main()
