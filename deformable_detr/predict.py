"""`python -m deformable_detr.predict`: deformable_detr/commands/predict.py's command (`deformable-detr predict`)."""

from .commands.predict import main

if __name__ == "__main__":
    main()
