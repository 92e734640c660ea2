"""TensorBoard event files of a run (`train.tensorboard: true`), in <run>/tensorboard/: the step
records' scalars (`train/`: losses, lr, gradient norm, images/s) at their global step, and at each
evaluation's, its AP, AP50, ... (`val/`), each category's AP (`val_AP_per_class/`) and pictures (the
first val images' predictions, the PR curves, the confusion matrix where supervision is installed:
inference/confusion.py). `tensorboard --logdir output` shows them. (run_directory.py writes them.)

Written by the `tensorboard` package's own event writer (the `tensorboard` extra: the one that shows
them): tensorboardX imports PyTorch where it is installed, which this package never does
at run time. A resumed run starts its file with TensorBoard's restart mark at the step after its
checkpoint, so that the steps an earlier process wrote past it (killed after its last checkpoint)
are dropped and each step shows once."""

import io
import time

from PIL import Image

from ..errors import optional


def require_tensorboard():
    """Before a run starts: `train.tensorboard: true` without the package is one line naming it."""
    optional("tensorboard.summary.writer.event_file_writer", "tensorboard", "train.tensorboard: true")


class TensorBoard:
    """An event file in `directory` (a new one per process: a resumed run adds its own). `purge_step`:
    the first step of a resumed run; what earlier files hold from it on is hidden."""

    def __init__(self, directory, purge_step: int | None = None):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2, summary_pb2
        self._writer = EventFileWriter(str(directory), flush_secs=30)
        if purge_step is not None:
            start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=purge_step, session_log=start))

    def scalars(self, values: dict, step: int, prefix: str):
        """`prefix`/name of each number in `values` (not bools)."""
        summary = self._summary.Summary(
            value=[
                self._summary.Summary.Value(tag=f"{prefix}/{name}", simple_value=float(value))
                for name, value in values.items()
                if isinstance(value, (int, float)) and not isinstance(value, bool)
            ]
        )
        self._add(summary, step)

    def image(self, tag: str, image: Image.Image, step: int):
        png = io.BytesIO()
        image.convert("RGB").save(png, format="PNG")
        picture = self._summary.Summary.Image(
            height=image.height, width=image.width, colorspace=3, encoded_image_string=png.getvalue()
        )
        self._add(self._summary.Summary(value=[self._summary.Summary.Value(tag=tag, image=picture)]), step)

    def _add(self, summary, step: int):
        self._writer.add_event(self._event.Event(wall_time=time.time(), step=step, summary=summary))

    def flush(self):
        self._writer.flush()

    def close(self):
        self._writer.close()
