"""Weights files: the format and its atomic writer (`files.py`), training checkpoints, loading into a
model (`loading.py`, hf:// through `hub.py`), and conversion from and to PyTorch layouts."""
