"""`python -m deformable_detr.train`: deformable_detr/commands/train.py's command (`deformable-detr train`)."""

from .commands.train import main

if __name__ == "__main__":
    main()
