"""`python -m deformable_detr.eval`: deformable_detr/commands/eval.py's command (`deformable-detr eval`)."""

from .commands.eval import main

if __name__ == "__main__":
    main()
