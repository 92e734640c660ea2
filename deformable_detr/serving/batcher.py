"""`Batcher`: images of requests arriving together run as one batch, on one worker thread.

    batcher = Batcher(run, max_batch=8, max_wait=0.01, max_queue=64)
    batcher.start(warm_up)                       # the worker: warm_up() first, then batches
    futures = batcher.submit([(image, key), ...])  # each future: (its result, the size of its batch)
    batcher.close()                              # what is queued runs; then the worker stops

`run(images, key)` gets images of one `key` (jobs of different keys never share a batch) and returns a
result per image. The worker alone calls `run` and `warm_up`: MLX is touched by this one thread while
serving. A batch starts when `max_batch` images of the first waiting image's key are queued, or
`max_wait` seconds after that image arrived, whichever is first; the others wait their turn in order.
A future cancelled before its batch runs (its request cancelled) takes its image out of that batch.
Before the worker ends it clears its thread's MLX streams (`mx.clear_streams`), as MLX asks of every
worker thread (ml-explore/mlx#4373): left to the C++ destructors that run as a thread ends, after Python
has let go of it, the teardown of what the thread compiled (`nn.relu` is an `mx.compile`d function) takes
the GIL, and where the interpreter is finalizing by then (the server's exit, right after `close`) Python
ends that thread inside a destructor: the process aborts ("terminate called without an active exception",
exit -6; 13-19 in 40 exits of a thread that ran `nn.relu`, none with the streams cleared)."""

import collections
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field

import mlx.core as mx


class QueueFull(Exception):
    """More images waiting than `max_queue`: try again later."""


class Closed(Exception):
    """The batcher is shutting down: it takes nothing new."""


@dataclass
class Job:
    image: object
    key: object
    future: Future = field(default_factory=Future)
    arrived: float = field(default_factory=time.monotonic)


class Batcher:
    def __init__(self, run, max_batch: int = 8, max_wait: float = 0.01, max_queue: int = 64):
        self.run, self.max_batch, self.max_wait, self.max_queue = run, max_batch, max_wait, max_queue
        self.ready = threading.Event()  # set once warm_up has run
        self.batch_sizes = collections.Counter()  # forward batch size -> how many ran
        self._jobs = collections.deque()
        self._changed = threading.Condition()
        self._closed = False
        self._worker = None

    @property
    def queued(self) -> int:
        """Images waiting for a batch (not those running)."""
        with self._changed:
            return len(self._jobs)

    def start(self, warm_up=None) -> None:
        self._worker = threading.Thread(target=self._serve, args=(warm_up,), name="batcher", daemon=True)
        self._worker.start()

    def submit(self, items: list) -> list[Future]:
        """Queues (image, key) pairs, all or none -> a Future per image of (result, batch size). QueueFull
        where they would pass `max_queue`, Closed after `close`."""
        with self._changed:
            if self._closed:
                raise Closed("the server is shutting down")
            if len(self._jobs) + len(items) > self.max_queue:
                raise QueueFull(f"{len(self._jobs)} images are waiting (at most {self.max_queue}): try again soon")
            jobs = [Job(image, key) for image, key in items]
            self._jobs.extend(jobs)
            self._changed.notify()
        return [job.future for job in jobs]

    def close(self) -> None:
        """Takes nothing new, runs what is queued (at once: no waiting for more), then stops the worker."""
        with self._changed:
            self._closed = True
            self._changed.notify()
        if self._worker is not None:
            self._worker.join()

    def _serve(self, warm_up) -> None:
        try:
            try:
                if warm_up is not None:
                    warm_up()
            except Exception:  # noqa: BLE001  (a model that cannot run: never ready, every request refused)
                traceback.print_exc()
                with self._changed:
                    self._closed = True
            else:
                self.ready.set()
            while (batch := self._next_batch()) is not None:
                self._run(batch)
        finally:
            mx.clear_streams()  # now, on this thread, not in its exit's destructors (the docstring says why)

    def _next_batch(self) -> list[Job] | None:
        """The oldest waiting job and the next ones of its key, once there are `max_batch` or its wait is
        over; None when closed and nothing is left."""
        with self._changed:
            while not self._jobs and not self._closed:
                self._changed.wait()
            if not self._jobs:
                return None
            first = self._jobs[0]
            deadline = first.arrived + self.max_wait
            while not self._closed and len(self._matching(first.key)) < self.max_batch:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            batch = self._matching(first.key)[: self.max_batch]
            taken = {id(job) for job in batch}
            self._jobs = collections.deque(job for job in self._jobs if id(job) not in taken)
            return batch

    def _matching(self, key) -> list[Job]:
        return [job for job in self._jobs if job.key == key]

    def _run(self, batch: list[Job]) -> None:
        # A request cancelled while its images waited (the server's shutdown timeout over) cancels their
        # futures: those images are not run.
        batch = [job for job in batch if job.future.set_running_or_notify_cancel()]
        if not batch:
            return
        images = [job.image for job in batch]
        for job in batch:
            job.image = None  # the images are freed once run, before their requests are answered
        try:
            results = self.run(images, batch[0].key)
        except Exception as error:  # noqa: BLE001  (the requests of this batch fail; the worker goes on)
            del images
            for job in batch:
                job.future.set_exception(error)
            return
        del images
        with self._changed:  # read by the stats route on another thread
            self.batch_sizes[len(batch)] += 1
        for job, result in zip(batch, results, strict=True):
            job.future.set_result((result, len(batch)))
