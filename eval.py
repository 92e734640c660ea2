"""Evaluate a checkpoint (COCO box AP): `deformable_detr/commands/eval.py` (also `deformable-detr eval`,
`python -m deformable_detr.eval`).

    python eval.py --checkpoint W [--config C] [--data-path P] [--batch-size N] [--output-dir D] [section.key=value ...]
"""

from deformable_detr.commands.eval import main

if __name__ == "__main__":
    main()
