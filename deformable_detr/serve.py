"""`python -m deformable_detr.serve`: deformable_detr/commands/serve.py's command (`deformable-detr serve`)."""

from .commands.serve import main

if __name__ == "__main__":
    main()
