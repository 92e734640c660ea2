"""`python -m deformable_detr.check`: deformable_detr/commands/check.py's command (`deformable-detr check`)."""

from .commands.check import main

if __name__ == "__main__":
    main()
