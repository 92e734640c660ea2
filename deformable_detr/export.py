"""`python -m deformable_detr.export`: deformable_detr/commands/export.py's command (`deformable-detr export`)."""

from .commands.export import main

if __name__ == "__main__":
    main()
