"""`python -m deformable_detr.convert`: deformable_detr/commands/convert.py's command (`deformable-detr convert`)."""

from .commands.convert import main

if __name__ == "__main__":
    main()
