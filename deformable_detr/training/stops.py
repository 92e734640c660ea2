"""How a training run stops: Ctrl-C or SIGTERM at the end of the step under way (`StopSignals`), and
whatever else ends the loop early as one line with an exit status (`stopping_cleanly`), with a
checkpoint where the model is as a step left it."""

import contextlib
import signal
import threading
import traceback

from ..data import BadImageError
from ..errors import CommandError


class Interrupted(Exception):
    def __init__(self, signum: int, inside_step: bool):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.inside_step = signum, inside_step


class StopSignals:
    """SIGINT and SIGTERM, while the run is on: outside `deferred()` they raise Interrupted at once;
    inside, at its end (a second one at once, marked inside_step)."""

    def __init__(self):
        self.received, self.deferring, self._previous = None, False, {}

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self  # handlers can be set from the main thread only; elsewhere Python's own stay
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exception):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame):
        if not self.deferring or self.received is not None:
            raise Interrupted(signum, inside_step=self.deferring)
        self.received = signum

    @contextlib.contextmanager
    def deferred(self):
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False
        if self.received is not None:
            raise Interrupted(self.received, inside_step=False)


@contextlib.contextmanager
def stopping_cleanly(trainer, run, progress):
    """Whatever ends the loop early becomes a CommandError (one line, an exit status), with a
    checkpoint where the model is as a step left it."""
    try:
        yield
    except Interrupted as interrupted:
        if interrupted.inside_step:
            raise CommandError(
                f"interrupted ({interrupted}) twice: stopped inside a step, without saving; "
                f"the last checkpoint, intact: {run.checkpoint}",
                128 + interrupted.signum,
            ) from None
        run.save(trainer, progress)
        raise CommandError(
            f"interrupted ({interrupted}) at epoch {progress.epoch}, step {progress.step}; "
            f"checkpoint: {run.checkpoint} (continue with --resume {run.checkpoint})",
            128 + interrupted.signum,
        ) from None
    except BadImageError as error:
        run.save(trainer, progress)
        raise CommandError(
            f"{error}; to skip unreadable images, set data.skip_bad_images=true and continue with "
            f"--resume {run.checkpoint} (saved at epoch {progress.epoch}, step {progress.step})"
        ) from None
    except CommandError:
        raise
    except Exception as error:  # noqa: BLE001  (a bug or a failure of the machine: said in one line)
        run.log({"global_step": progress.global_step, "error": repr(error), "traceback": traceback.format_exc()})
        raise CommandError(
            f"{type(error).__name__}: {error} at epoch {progress.epoch}, step {progress.step} "
            f"(the traceback is in {run.log_path}); the last checkpoint, intact: {run.checkpoint}"
        ) from error
