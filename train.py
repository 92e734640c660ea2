"""Train Deformable DETR: `python train.py --config configs/r50.yaml`.

Not built yet. The model (`deformable_detr/`) lands with issue 3 and this trainer with issue 4;
what runs today is the attention core in `kernels/` (see README.md, "What runs today").
"""

import sys

if __name__ == "__main__":
    sys.exit("train.py: the trainer is not built yet (issue 4); see README.md, 'What runs today'.")
