"""Training: the trainer's step (`trainer.py`) with its memory plan (`memory_plan.py`), optimizer and
EMA, the loop (`engine.py`) and how it stops (`stops.py`), the run directory (`run_directory.py`),
its one owner (`run_lock.py`) and TensorBoard event files (`tensorboard.py`)."""
