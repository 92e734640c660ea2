"""Evaluate a checkpoint on COCO with pycocotools: `python eval.py --config C --checkpoint W`.

Not built yet: it lands with issue 5; see README.md, "What runs today".
"""

import sys

if __name__ == "__main__":
    sys.exit("eval.py: COCO evaluation is not built yet (issue 5); see README.md, 'What runs today'.")
