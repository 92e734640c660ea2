"""Batches from any dataset of the interface in `deformable_detr/data/__init__.py`: a deterministic
order, per-sample augmentation seeds, padding to the largest image, mlx-data worker threads with
prefetch."""

import threading
import time
import warnings

import numpy as np

from .images import BadImageError


def collate(samples):
    """Pad images to the largest in the batch: -> images (B, H, W, 3), mask (B, H, W) True on
    padding, and the targets."""
    height = max(p.shape[0] for p, _ in samples)
    width = max(p.shape[1] for p, _ in samples)
    images = np.zeros((len(samples), height, width, 3), np.float32)
    mask = np.ones((len(samples), height, width), bool)
    for i, (pixels, _) in enumerate(samples):
        images[i, : pixels.shape[0], : pixels.shape[1]] = pixels
        mask[i, : pixels.shape[0], : pixels.shape[1]] = False
    return images, mask, [t for _, t in samples]


class DataLoader:
    """Deterministic batches: the order is a permutation drawn from (seed, epoch), each sample's
    augmentation from (seed, epoch, index), so a run resumed at any step sees the same data.

    A step takes the next `batch_size` images of the order; with several processes each takes its
    share (`batch_size / world_size` images: rank r the r-th), in micro-batches of
    `micro_batch_size` (default: the whole share), each padded to its own largest image. Batches are
    loaded by `num_workers` mlx-data threads, `prefetch` micro-batches ahead."""

    def __init__(
        self,
        dataset,
        batch_size,
        shuffle=True,
        seed=0,
        num_workers=2,
        prefetch=2,
        rank=0,
        world_size=1,
        drop_last=True,
        micro_batch_size=None,
    ):
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, batch_size, shuffle, seed
        self.drop_last = drop_last  # training: whole steps; evaluation: every image
        self.num_workers, self.prefetch, self.rank, self.world_size = num_workers, prefetch, rank, world_size
        self.micro_batch_size = micro_batch_size or batch_size // world_size
        if batch_size % (world_size * self.micro_batch_size):
            raise ValueError(f"a batch of {batch_size} does not split into {world_size} x {self.micro_batch_size}")
        self.skipped_messages = []  # each skipped image's, until the one consuming them takes them

    def batches_per_epoch(self):
        """Steps per epoch."""
        return len(self._steps(0))

    def _steps(self, epoch) -> list[list[np.ndarray]]:
        """This process's micro-batches (dataset indices) of each step of `epoch`."""
        order = np.arange(len(self.dataset))
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))
        steps = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        if self.drop_last:  # whole steps only, the same number for every process
            steps = [step for step in steps if len(step) == self.batch_size]
        share, micro = self.batch_size // self.world_size, self.micro_batch_size
        shares = [step[self.rank * share : (self.rank + 1) * share] for step in steps]
        return [[images[i : i + micro] for i in range(0, len(images), micro)] for images in shares]

    def epoch(self, epoch: int, start: int = 0):
        """Yield, for each step of `epoch` from step `start` on, its micro-batches: a list of
        (images, mask, targets)."""
        import mlx.data as dx

        steps = self._steps(epoch)[start:]
        batches = [batch for step in steps for batch in step]
        if not batches:
            return

        stopping = threading.Event()

        def load(element):
            """Runs in an mlx-data thread: nothing may escape it, errors travel back as text."""
            if stopping.is_set():
                return {**_pack([], []), "position": element["position"]}
            samples, skipped = [], []
            try:
                for i in element["indices"].tolist():
                    try:
                        samples.append(self.dataset.sample(i, np.random.default_rng([self.seed, epoch, i])))
                    except BadImageError as error:
                        if not self.dataset.skip_bad_images:
                            raise
                        skipped.append(str(error))
            except Exception as error:  # noqa: BLE001
                packed = {**_pack([], []), "error": _text(f"{type(error).__name__}: {error}")}
            else:
                packed = _pack(samples, skipped)
            return {**packed, "position": element["position"]}

        buffer = dx.buffer_from_vector(
            [{"indices": np.asarray(b, np.int64), "position": np.array(i)} for i, b in enumerate(batches)]
        )
        stream = buffer.to_stream().sample_transform(load).prefetch(self.prefetch, self.num_workers)
        elements = _in_order(stream)
        try:
            for step in steps:
                micro_batches = [self._received(next(elements)) for _ in step]
                if any(len(targets) for _, _, targets in micro_batches):
                    yield [batch for batch in micro_batches if len(batch[2])]
        finally:
            # Stopped early (an error, or the consumer closed us): let the worker threads run out the
            # stream, each remaining batch a no-op, so none is left running when the process exits
            # (mlx-data's threads still running at exit abort it: "terminate called without an
            # active exception").
            stopping.set()
            for _ in stream:
                pass
            # Freeing the stream (when this generator ends) joins its pool's threads, and mlx-data
            # 0.1.0's pool signals stop without its mutex: a worker between its last task and its wait
            # misses the signal and the join hangs (ml-explore/mlx-data PR #112; twice in this
            # project's clean-clone suite runs, and within 500 create-drain-free rounds here). Workers
            # already waiting do get the signal: give them a moment to get there.
            time.sleep(0.01)

    def _received(self, element):
        """A loaded micro-batch -> (images, mask, targets); its skipped images warned of (and kept for
        `take_skipped`), its error raised."""
        if len(element["error"]):
            kind, _, message = bytes(element["error"]).decode().partition(": ")
            raise (BadImageError if kind == "BadImageError" else RuntimeError)(message)
        for message in filter(None, bytes(element["skipped"]).decode().split("\n")):
            self.skipped_messages.append(message)
            warnings.warn(f"skipping {message}", stacklevel=3)
        return _unpack(element)

    def take_skipped(self) -> list[str]:
        """The messages of the images skipped since the last call (each naming the file), for a log."""
        taken, self.skipped_messages = self.skipped_messages, []
        return taken


def _in_order(stream):
    """mlx-data's worker threads may finish batches out of order: hold early ones back."""
    waiting, expected = {}, 0
    for element in stream:
        waiting[int(element["position"])] = {k: np.array(v, copy=True) for k, v in element.items()}
        while expected in waiting:
            yield waiting.pop(expected)
            expected += 1


def _text(message: str) -> np.ndarray:
    return np.array(bytearray(message.encode()), dtype=np.uint8)


def _pack(samples, skipped: list[str]):
    """A batch as the flat arrays mlx-data carries between threads."""
    images, mask, targets = (
        collate(samples) if samples else (np.zeros((0, 1, 1, 3), np.float32), np.zeros((0, 1, 1), bool), [])
    )
    return {
        "images": images,
        "mask": mask.astype(np.uint8),  # mlx-data carries no bool
        "skipped": _text("\n".join(skipped)),
        "error": np.zeros(0, np.uint8),
        "counts": np.array([len(t["labels"]) for t in targets], np.int64),
        "labels": np.concatenate([t["labels"] for t in targets] or [np.zeros(0, np.int64)]),
        "boxes": np.concatenate([t["boxes"] for t in targets] or [np.zeros((0, 4), np.float32)]),
        "image_id": np.array([t["image_id"] for t in targets], np.int64),
        "orig_size": np.array([t["orig_size"] for t in targets], np.int64).reshape(-1, 2),
        "size": np.array([t["size"] for t in targets], np.int64).reshape(-1, 2),
    }


def _unpack(element):
    ends = np.cumsum(element["counts"])
    starts = ends - element["counts"]
    targets = [
        {
            "labels": element["labels"][a:b],
            "boxes": element["boxes"][a:b],
            "image_id": int(element["image_id"][i]),
            "orig_size": element["orig_size"][i],
            "size": element["size"][i],
        }
        for i, (a, b) in enumerate(zip(starts, ends, strict=True))
    ]
    return element["images"], element["mask"].astype(bool), targets
