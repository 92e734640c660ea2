"""How a training run stops: Ctrl-C or SIGTERM (`StopSignals`), and whatever else ends the loop early,
as one line with an exit status (`stopping_cleanly`), with a checkpoint where the model is as a step
left it.

Signals, counted one by one: a first one stops the run at the end of the step under way (at once
between steps or during an evaluation), saving the progress; a second inside the same step stops it
as soon as Python has control back, without saving; any signal during a save waits for its end (a
checkpoint is never left half written), and the run stops then. CPython's C handler only marks a
signal pending, so two that arrive while MLX runs native code reach Python's handler as one call;
it also writes each one's number, one byte per delivery, to the wakeup file descriptor, where they
are counted."""

import contextlib
import os
import signal
import threading
import traceback

from ..data import BadImageError
from ..errors import CommandError

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# What a signal does now: stop at once, or be held to the end of a step or of a save
BETWEEN, STEP, SAVING, STOPPING = "between steps", "in a step", "saving", "stopping"
SAVE, SAVED, UNSAVED = "save", "saved", "unsaved"  # the progress: to be saved, just saved, left unsaved


class Interrupted(BaseException):
    """A stop by signal: `signums` the signals delivered until then, in order; `progress` SAVE,
    SAVED (the save under way when they came completed) or UNSAVED (a second signal inside a step).
    A BaseException, as KeyboardInterrupt: raised wherever the main thread is, it is taken by no
    `except Exception` on its way."""

    def __init__(self, signums: list, progress: str):
        super().__init__(names(signums))
        self.signums, self.progress = list(signums), progress


def names(signums: list) -> str:
    return ", ".join(signal.Signals(signum).name for signum in signums)


class StopSignals:
    """SIGINT and SIGTERM while the run is on: at once between steps; inside `step()` at its end (a
    second at once, unsaved); inside `saving()` at its end; after `stopping()` held until the run ends."""

    def __init__(self):
        self.state = BETWEEN
        self.delivered = []  # signal numbers, in the order they came (the wakeup fd's bytes)
        self._calls, self._last = 0, None  # the handler's: one per signal, fewer where CPython merged them
        self._at_step = 0  # signals counted when the step under way began
        self._previous, self._wakeup = {}, None

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self  # handlers can be set from the main thread only; elsewhere Python's own stay
        read, write = os.pipe()
        for descriptor in (read, write):
            os.set_blocking(descriptor, False)  # set_wakeup_fd's condition; reads stop when it is empty
        self._wakeup = (read, write, signal.set_wakeup_fd(write))
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exception):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self._wakeup is not None:
            read, write, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            os.close(read)
            os.close(write)
            self._wakeup = None

    def count(self) -> int:
        """Signals delivered so far: the wakeup fd's bytes, read now; at least the handler's calls (a
        call can run before the C handler, on another thread, has written its byte)."""
        while self._wakeup is not None:
            try:
                data = os.read(self._wakeup[0], 256)
            except BlockingIOError:
                break
            self.delivered.extend(signum for signum in data if signum in SIGNALS)
        return max(len(self.delivered), self._calls)

    def _handle(self, signum, frame):
        self._calls, self._last = self._calls + 1, signum
        if self.state == BETWEEN:
            self._stop(SAVE)
        if self.state == STEP and self.count() - self._at_step >= 2:
            self._stop(UNSAVED)

    def _stop(self, progress: str):
        self.state = STOPPING  # what comes after is held: the stop under way is not interrupted
        raise Interrupted(self.received(), progress)

    def received(self) -> list:
        """The signals delivered so far, in order."""
        self.count()
        return self.delivered or [self._last]  # (the race `count` tells of: the handler's alone)

    @contextlib.contextmanager
    def step(self):
        """A training step: a first signal stops the run at its end, a second at once."""
        self.state, self._at_step = STEP, self.count()
        try:
            yield
        except BaseException:
            self.stopping()  # the step failed: the run ends, and no signal may save over the checkpoint that stands
            raise
        if self.state == STEP:
            self.state = BETWEEN
        signals = self.count() - self._at_step
        if self.state == BETWEEN and signals:
            self._stop(SAVE if signals == 1 else UNSAVED)

    @contextlib.contextmanager
    def saving(self):
        """A checkpoint being written: signals wait for its end, then stop the run (its progress saved)."""
        previous, before = self.state, self.count()
        self.state = SAVING
        try:
            yield
        except BaseException:
            self.stopping()  # the save failed (a full disk): the run ends with the checkpoint that stands
            raise
        self.state = previous
        if previous == BETWEEN and self.count() > before:
            self._stop(SAVED)

    def stopping(self):
        """The run is ending (a stop under way): signals from now on are held, and change nothing."""
        self.state = STOPPING


@contextlib.contextmanager
def stopping_cleanly(trainer, run, progress, signals: StopSignals):
    """Whatever ends the loop early becomes a CommandError (one line, an exit status), with a
    checkpoint where the model is as a step left it."""
    try:
        yield
    except Interrupted as interrupted:
        signals.stopping()
        status = 128 + interrupted.signums[0]
        if interrupted.progress == UNSAVED:
            raise CommandError(
                f"a second signal ({names(signals.received())}) inside epoch {progress.epoch}'s step "
                f"{progress.step + 1}: stopped there, without saving; {run.standing_checkpoint()}",
                status,
            ) from None
        if interrupted.progress == SAVE:
            with signals.saving():
                run.save(trainer, progress)
        raise CommandError(
            f"interrupted ({names(signals.received())}) at epoch {progress.epoch}, step {progress.step}; "
            f"checkpoint: {run.checkpoint} (continue with --resume {run.checkpoint})",
            status,
        ) from None
    except BadImageError as error:
        signals.stopping()
        with signals.saving():
            run.save(trainer, progress)
        raise CommandError(
            f"{error}; to skip unreadable images, set data.skip_bad_images=true and continue with "
            f"--resume {run.checkpoint} (saved at epoch {progress.epoch}, step {progress.step})"
        ) from None
    except CommandError:
        signals.stopping()
        raise
    except Exception as error:  # noqa: BLE001  (a bug or a failure of the machine: said in one line)
        signals.stopping()
        run.log({"global_step": progress.global_step, "error": repr(error), "traceback": traceback.format_exc()})
        raise CommandError(
            f"{type(error).__name__}: {error} at epoch {progress.epoch}, step {progress.step} "
            f"(the traceback is in {run.log_path}); {run.standing_checkpoint()}"
        ) from error
