"""`Detector`: a trained model with its config and class names, as one object.

    detector = Detector.load("output/shapes/checkpoint.safetensors")  # or hf://ORG/NAME, converted weights
    results = detector.predict("photos/", threshold=0.5)  # an image, array, path, folder, or a list of them
    results[0].boxes, results[0].scores, results[0].names, results[0].to_json()
    results = detector.predict("photos/", skip_unreadable=True)  # unreadable files: warned of, left out
    results.skipped  # [(path, reason)] of those
    detector.predict("aerial.jpg", slice=(256, 256), overlap=0.2)  # small objects: on slices (inference/slicing.py)
    for frame in detector.track(frames, "bytetrack"): frame.track_ids  # identities through a video
    detector.batch_key(image)  # (height, width) the model sees: only images of one key share a forward
    detector.evaluate("data/coco")  # COCO AP, as eval.py
    detector.export("huggingface", "my-model")  # or "torch"

The commands (`predict`, `eval.py`, `export`) are built on it.

The batching rule: a batch never changes an answer. Images padded to the largest of a batch see the
padding (the input projection's GroupNorm takes statistics over it; frozen batch norm's shift makes it
non-zero for the next convolution): up to 0.09 in score on the shapes val set. So `detect` and `predict`
put only images of one resized size (`batch_key`) in a forward, none padded (grouped by `inputs.grouped`,
the one grouping rule; the server's batcher keys its queue by `batch_key` too), and each image's results
are those it has alone, to float rounding (the CPU BLAS rounds one image's small matrix products
differently from a batch's: measured at most 5e-7 in score, 5e-5 pixels in a box). COCO evaluation
(evaluation.py) keeps the authors' batches padded to the largest, as their AP is computed so."""

import contextlib
import dataclasses
import itertools
import json
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import kernels

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from PIL import Image

from ..config import Config, config_to_dict, load_config
from ..data import build_dataset, collate, dataset_reads
from ..data.classes import describe_match, match_classes
from ..data.files import read_yaml
from ..data.transforms import resized_shape
from ..deploy.inputs import model_pixels
from ..deploy.mlxfn import export_mlx
from ..deploy.onnx.export import export_onnx
from ..errors import UsageError
from ..models import post_process
from ..models.combinations import check_model
from ..models.precision import Precision, resolve_precision
from ..weights import conversion
from ..weights.loading import config_from_weights, load_trained_model
from .attention_points import encoder_queries, in_pixels, recording
from .confusion import THRESHOLD, draw_confusion_matrix
from .evaluation import evaluate
from .inputs import Unreadable, as_image, find_inputs, grouped, open_image, opened_batches
from .slicing import OVERLAP, check_slice, sliced_detect
from .tracking import Tracking
from .visualize import draw_detections, pr_curves

CONFIG_SECTIONS = [section.name for section in dataclasses.fields(Config) if section.name != "seed"]


@dataclass
class Detections:
    """One image's detections at or above the threshold, best first: `boxes` (n, 4) x0, y0, x1, y1 in
    the image's pixels, `scores` (n,), `labels` (n,) category ids, `names` their class names,
    `queries` (n,) the decoder query of each. With `attention`, in_pixels' "points" (n, heads,
    levels, points, 2), "weights", "reference" (n, 2) (and "box") of the decoder layer asked for;
    with an encoder pixel, `encoder`: those of that pixel's encoder query on each level."""

    boxes: np.ndarray
    scores: np.ndarray
    labels: np.ndarray
    names: list
    queries: np.ndarray
    image_size: tuple  # (width, height)
    path: Path | None = None
    attention: dict | None = None
    encoder: dict | None = field(default=None, repr=False)
    track_ids: np.ndarray | None = None  # (n,) from `Detector.track`; -1: no identity (yet)

    def __len__(self) -> int:
        return len(self.scores)

    def at_threshold(self, threshold: float) -> "Detections":
        """Those scoring at least `threshold` (best first still), with their names and sampling points."""
        return self.where(self.scores >= threshold)

    def where(self, kept: np.ndarray) -> "Detections":
        """Those where the boolean `kept` (n,) is true, in their order, with their names, sampling points, ids."""
        arrays = {k: getattr(self, k)[kept] for k in ("boxes", "scores", "labels", "queries")}
        if self.track_ids is not None:
            arrays["track_ids"] = self.track_ids[kept]
        names = [name for name, keep in zip(self.names, kept, strict=True) if keep]
        attention = None if self.attention is None else {k: v[kept] for k, v in self.attention.items()}
        return dataclasses.replace(self, **arrays, names=names, attention=attention)

    def to_json(self) -> list[dict]:
        """A record per detection: label, name, score, box, query (and track_id, tracked); with
        `attention`, its reference point (and box), sampling points and weights, rounded."""
        records = []
        for j, (score, label, name, box, query) in enumerate(
            zip(self.scores, self.labels, self.names, self.boxes, self.queries, strict=True)
        ):
            record = {"label": int(label), "name": name, "score": float(score)}
            record |= {"box": [float(v) for v in box], "query": int(query)}
            if self.track_ids is not None:
                record["track_id"] = int(self.track_ids[j])
            if self.attention is not None:
                record["reference_point"] = np.round(self.attention["reference"][j], 3).tolist()
                if "box" in self.attention:
                    record["reference_box"] = np.round(self.attention["box"][j], 3).tolist()
                record["sampling_points"] = np.round(self.attention["points"][j], 3).tolist()
                record["sampling_weights"] = np.round(self.attention["weights"][j], 6).tolist()
            records.append(record)
        return records

    def draw(self, image=None) -> Image.Image:
        """The boxes, names and scores drawn on a copy of `image` (default: the file it came from)."""
        if image is None and self.path is None:
            raise ValueError("these detections are of an image given in memory: draw(image) needs it")
        image = open_image(self.path) if image is None else as_image(image)
        named = {int(label): name for label, name in zip(self.labels, self.names, strict=True)}
        return draw_detections(image, {"scores": self.scores, "labels": self.labels, "boxes": self.boxes}, named, 0.0)


class Predictions(list):
    """What `Detector.predict` returns: a list of `Detections`, one per image read, in input order;
    `skipped`: (path, reason) of each file left out as unreadable (`skip_unreadable=True`), in order."""

    def __init__(self, results=(), skipped=()):
        super().__init__(results)
        self.skipped = list(skipped)


class Detector:
    """A model in evaluation mode, its `cfg`, its `class_names` ({category id: name}) and the precision
    its products run in: `precision`, a models.precision.Precision (what ran, what was asked, why),
    float32 unless given; `Detector.load(precision="auto")` runs in bfloat16 the products where bfloat16 was
    measured faster on this CPU (oneDNN's AMX or AVX512-BF16 kernels) and the rest in float32, float32
    throughout elsewhere (a GPU too). The weights stay float32 either way (an export writes them as they are)."""

    def __init__(self, model, cfg: Config, class_names: dict, source=None, precision: Precision | None = None):
        self.model, self.cfg, self.class_names, self.source = model, cfg, class_names, source
        self.precision = precision or Precision()
        self.kept_weights = kernels.onednn.kept_weights()  # the weights do not change here: their copies kept
        model.eval()

    def products(self, looking: bool = False):
        """The context the forwards run in: the products in `precision` (at `auto`, those its rule says
        pay), the copies of the weights oneDNN's kernels need kept in `kept_weights`
        (kernels.onednn.products_in). `looking`: a forward that records where the model looks (the
        attention view), float32 at `auto` (models/precision.py says why)."""
        if looking and self.precision.asked == "auto":
            return kernels.onednn.products_in(mx.float32, kept=self.kept_weights)
        return kernels.onednn.products_in(self.precision.dtype, kept=self.kept_weights, rule=self.precision.rule)

    @staticmethod
    def config_for(weights, config=None, overrides=()) -> Config:
        """The config of the model of `weights`: the one the weights record (`config`: a YAML file
        instead), with `overrides` (section.key=value)."""
        return load_config(config, overrides) if config else config_from_weights(weights, overrides)

    @classmethod
    def load(cls, weights, config=None, overrides=(), raw_weights: bool = False, precision: str = "auto") -> "Detector":
        """`weights`: a training checkpoint (its EMA where it has one, unless `raw_weights`), converted
        weights, or `hf://ORG/NAME[@REVISION]`. `config`, `overrides`: as `config_for`, or a
        Config. `precision`: auto, float32 or bfloat16, resolved here (models.precision.resolve_precision),
        before the weights are read; so are the model's settings checked (a UsageError naming the keys that do
        not go together: models/combinations.py)."""
        resolved = resolve_precision(precision)
        cfg = config if isinstance(config, Config) else cls.config_for(weights, config, overrides)
        check_model(cfg.model)
        model, recorded = load_trained_model(weights, cfg, raw=raw_weights)
        return cls(model, cfg, recorded or _dataset_names(cfg), source=weights, precision=resolved)

    def predict(
        self,
        images,
        threshold: float = 0.5,
        batch_size: int = 1,
        attention: bool = False,
        attention_layer: int = -1,
        encoder_pixel: tuple | None = None,
        skip_unreadable: bool = False,
        slice: tuple | None = None,
        overlap: float = OVERLAP,
    ) -> "Predictions":
        """A result per image of `images`: a PIL image, an (H, W, 3) uint8 array, a path, a folder (its images), a glob,
        or a list of these, in input order: the best `evaluation.top_k` (query, class) pairs of the model's config
        (those eval.py scores: 100, DINO's 300) at or above `threshold`. A forward takes at most `batch_size` images of
        one `batch_key` (the batching rule: the module's docstring), so the results are those of `batch_size=1`; an
        image waits for others of its size while at most 4 x `batch_size` images wait (inputs.opened_batches).
        `attention`: the sampling points and weights of decoder layer `attention_layer` for each detection;
        `encoder_pixel` (x, y): where the last encoder layer's queries at that pixel look. A file that cannot be read
        (not an image, truncated) raises, naming it; with `skip_unreadable`, each is named in a warning and left out,
        and the result's `skipped` lists them: [(path, reason)]. `slice` (W, H): each image's detections from W x H
        slices overlapping by `overlap` of a slice, `batch_size` slices a forward, in the image's pixels
        (inference/slicing.py)."""
        sliced = None if slice is None else check_slice(slice, overlap)
        if sliced and (attention or encoder_pixel is not None):
            raise UsageError("slice: attention and encoder_pixel show one forward of a whole image; not with slices")
        unreadable = Unreadable(skip_unreadable, "skip_unreadable=True", _warn_skipped)
        looking = (attention_layer if attention else None, encoder_pixel)
        found = {}  # {order read: Detections}
        for batch in self.predict_batches(images, unreadable, threshold, batch_size, looking, sliced):
            found.update((order, detections) for order, _, detections in batch)
        return Predictions([found[order] for order in sorted(found)], unreadable.skipped)

    def predict_batches(
        self, images, unreadable: Unreadable, threshold=0.5, batch_size=1, looking=(None, None), sliced=None
    ):
        """`predict`'s work as it goes, for a caller that uses each image once its forward is done (the predict
        command writes its pictures so): a list per forward of (order, image, Detections), `order` counting the
        images read. `unreadable`: what a file that cannot be read does (`inputs.Unreadable`); `looking`: (the
        decoder layer whose sampling points are asked, the encoder pixel whose queries), None where not asked;
        `sliced`: check_slice's ((W, H), overlap) or None."""
        sources = []  # (the file, or the image given)
        for item in images if isinstance(images, (list, tuple)) else [images]:
            is_path = isinstance(item, (str, Path))
            sources += [(path, None) for path in find_inputs([item])] if is_path else [(None, as_image(item))]
        # sliced: an image at a time (its slices make the batches), so no large image waits for others
        for batch in opened_batches(sources, 1 if sliced else batch_size, unreadable, self.batch_key):
            if sliced:
                [(order, path, image)] = batch
                merged = sliced_detect(self, image, *sliced, threshold, batch_size)
                yield [(order, image, self._kept(merged, threshold, image.size, path))]
                continue
            detected = self._forward([image for _, _, image in batch], *looking)
            yield [
                (order, image, self._kept(one, threshold, image.size, path))
                for (order, path, image), one in zip(batch, detected, strict=True)
            ]

    def track(
        self,
        frames,
        tracker: str = "bytetrack",
        threshold: float = 0.5,
        batch_size: int = 1,
        frame_rate: float = 30.0,
        **options,
    ):
        """Identities through a video: `frames`, an iterable of images (PIL, (H, W, 3) uint8 arrays) in
        order -> a generator of each frame's detections with `track_ids` (n,), -1 where there is no
        identity: those at `threshold` as `predict` gives them, and with ByteTrack the lower-scored ones
        it matched to a track (inference/tracking.py). `tracker`: bytetrack, sort or ocsort, Roboflow's
        `trackers` (the `track` extra); `frame_rate` the video's; `options` `Tracking`'s (duplicates,
        low_score, reidentify: True, False or a dict of `Identities`' options, e.g. {"margin": 0.3}) and the
        tracker's own arguments (e.g. lost_track_buffer=60); a name neither takes is a UsageError, here."""
        tracking = Tracking(tracker, threshold, frame_rate, **options)  # here: a bad name or no extra raises now

        def tracked(frames):
            while batch := [as_image(frame) for frame in itertools.islice(frames, batch_size)]:
                for image, detections in zip(batch, self.predict(batch, tracking.floor, batch_size), strict=True):
                    yield tracking.update(detections, image)

        return tracked(iter(frames))

    def batch_key(self, image) -> tuple[int, int]:
        """(height, width) of `image` (a PIL image, or its (width, height)) as the model sees it, resized
        as `detect` resizes: images of one key share a forward unpadded (the batching rule)."""
        width, height = image if isinstance(image, tuple) else image.size
        return resized_shape(width, height, self.cfg.data.val_size, self.cfg.data.max_size)

    def detect(self, images: list, decoder_layer: int | None = None, encoder_pixel=None) -> list[dict]:
        """PIL images (RGB) -> per image, in order, the config's `evaluation.top_k` best of `post_process` (numpy,
        boxes in the image's pixels): the detections eval.py scores (the authors' 100, DINO's 300). With
        `decoder_layer`, "attention": in_pixels' dict of every query of that layer's cross-attention; with
        `encoder_pixel` (x, y), "encoder": that pixel's encoder queries. One forward per `batch_key` among them
        (`inputs.grouped`): no image is padded, so each gets the results it has alone (the batching rule: the
        module's docstring)."""
        results = [None] * len(images)
        for group in grouped(range(len(images)), lambda i: self.batch_key(images[i]), max(len(images), 1)):
            found = self._forward([images[i] for i in group], decoder_layer, encoder_pixel)
            for i, result in zip(group, found, strict=True):
                results[i] = result
        return results

    def _forward(self, images: list, decoder_layer: int | None, encoder_pixel) -> list[dict]:
        """`detect` of images of one `batch_key`, in one forward."""
        pixels, mask, _ = collate([(model_pixels(image, self.batch_key(image)), None) for image in images])
        encoder_layer = -1 if encoder_pixel is not None else None
        asked = decoder_layer is not None or encoder_layer is not None
        with (
            recording(self.model, decoder_layer, encoder_layer) if asked else contextlib.nullcontext({}) as recorders,
            self.products(looking=asked),
        ):
            outputs = self.model(mx.array(pixels), mx.array(mask))
        results = post_process(outputs, [[image.height, image.width] for image in images], self.cfg.evaluation.top_k)
        calls = {part: recorder.calls[0] for part, recorder in recorders.items()}
        mx.eval(results, [(c.locations, c.weights, c.reference_points) for c in calls.values()])
        results = [{k: np.array(v) for k, v in result.items()} for result in results]
        for i, (image, result) in enumerate(zip(images, results, strict=True)):
            if "decoder" in calls:
                result["attention"] = in_pixels(calls["decoder"], i, image.width, image.height, result["queries"])
            if "encoder" in calls:
                queries = encoder_queries(calls["encoder"], i, *encoder_pixel, image.width, image.height)
                result["encoder"] = in_pixels(calls["encoder"], i, image.width, image.height, queries)
        return results

    def _kept(self, found: dict, threshold: float, size: tuple, path) -> Detections:
        names = [self.class_names.get(int(label), str(int(label))) for label in found["labels"]]
        arrays = {k: found[k] for k in ("boxes", "scores", "labels", "queries")}
        every = Detections(
            **arrays,
            names=names,
            image_size=size,
            path=path,
            attention=found.get("attention"),
            encoder=found.get("encoder"),
        )
        return every.at_threshold(threshold)

    def evaluate(
        self,
        path=None,
        split: str = "val",
        batch_size: int | None = None,
        output_dir=None,
        verbose: bool = False,
        threshold: float = THRESHOLD,
    ) -> dict:
        """COCO box AP on `split` of the config's dataset (`path`: its files elsewhere, as `data.path`:
        a folder, or YOLO's data.yaml; a config file or another file is a UsageError) -> what
        eval_results.json holds: the 12 numbers, "per_class", "ground_truth" (the boxes evaluated,
        crowd, and left out as training drops them: data/ground_truth.py) and "confusion_matrix" of the
        detections scoring at least `threshold` (confusion.py; not without supervision). The model's
        classes meet the dataset's by name (data/classes.py; the lines that say how go to stderr). With
        `output_dir`, writes there eval_results.json, detections_{split}.json (COCO results format),
        pr_curves.png and confusion_matrix.png. "precision": what the products ran in, asked, why."""
        if path is not None:
            _check_dataset_path(Path(path), self.cfg.data.dataset)
        data = self.cfg.data if path is None else dataclasses.replace(self.cfg.data, path=str(path))
        dataset = build_dataset(split, data)
        class_map = match_classes(self.class_names, dataset.class_names())
        for line in describe_match(self.class_names, dataset.class_names(), class_map, dataset.annotation_file):
            print(line, file=sys.stderr)
        with self.products():
            evaluation = evaluate(self.model, dataset, self.cfg, batch_size, verbose, class_map, threshold)
        evaluation.stats["precision"] = self.precision.to_json()
        if output_dir is not None:
            output_dir = Path(output_dir)
            output_dir.mkdir(parents=True, exist_ok=True)
            (output_dir / f"detections_{split}.json").write_text(json.dumps(evaluation.detections))
            (output_dir / "eval_results.json").write_text(json.dumps(evaluation.stats, indent=2))
            pr_curves(evaluation.curves, output_dir / "pr_curves.png")
            if "confusion_matrix" in evaluation.stats:
                draw_confusion_matrix(evaluation.stats["confusion_matrix"], output_dir / "confusion_matrix.png")
        return evaluation.stats

    def export(self, to: str, path, hf_backbone: str = "timm", **canvas) -> str:
        """The model for another framework: `to` "torch" (the authors' `.pth`), "huggingface" (a folder
        for transformers' from_pretrained; `hf_backbone` timm or transformers), "onnx" (the forward on
        a fixed canvas: `size` (H, W), `batch_size`, `postprocess`, `sampler`; deploy/onnx), or "mlx"
        (an `.mlxfn` file of the same forward, `mx.export_function`: `size`, `batch_size`, `postprocess`;
        deploy/mlxfn.py). -> a summary."""
        if to == "onnx":
            return export_onnx(self.model, self.cfg, Path(path), **canvas)
        if to == "mlx":
            return export_mlx(self.model, self.cfg, Path(path), **canvas)
        weights = {k: np.array(v) for k, v in tree_flatten(self.model.parameters())}
        source = self.source or "the model"
        if to == "torch":
            return conversion.export_torch(weights, config_to_dict(self.cfg)["model"], Path(path), source)
        if to == "huggingface":
            return conversion.export_huggingface(
                weights, config_to_dict(self.cfg), self.class_names, Path(path), hf_backbone, source
            )
        raise ValueError(f"export to {to!r}: expected torch, huggingface, onnx or mlx")


def _check_dataset_path(path: Path, dataset: str) -> None:
    """`evaluate`'s `path` where it is a file no reader of the config's `dataset` takes (a config YAML,
    a checkpoint, ...): a UsageError naming it, before a reader fails on it somewhere obscure."""
    if not path.is_file():
        return  # a folder, or nothing there: the dataset's reader names what it lacks
    takes = (
        "evaluate takes a dataset: a folder (COCO's annotations/ + val2017/, VOC's, Create ML's) or YOLO's data.yaml"
    )
    is_yaml = path.suffix.lower() in (".yaml", ".yml")
    if is_yaml and _is_config(path):
        raise UsageError(
            f"{path}: a config file, not a dataset; {takes} (a config is Detector.load's config, eval.py's --config)"
        )
    reads = dataset_reads(dataset)  # "folder", "yaml" or None (data/__init__.py's registry)
    if is_yaml and reads == "folder":
        raise UsageError(
            f"{path}: a YAML file, but data.dataset {dataset} reads a folder; YOLO's data.yaml takes data.dataset=yolo"
        )
    if reads == "folder" or (reads == "yaml" and not is_yaml):
        raise UsageError(f"{path}: a file, not a dataset; {takes}")


def _is_config(path: Path) -> bool:
    """Whether the YAML file holds a config: a section (model:, data:, ...) that is a mapping. A YOLO
    data.yaml has `names`, and its `train`/`val` (`train` is also a config section) are paths."""
    try:
        content = read_yaml(path)
    except ValueError:
        return False  # not YAML: the reader says so
    if not isinstance(content, dict) or "names" in content:
        return False
    return any(isinstance(content.get(section), dict) for section in CONFIG_SECTIONS)


def _warn_skipped(message: str) -> None:
    """`predict`'s report of a file it left out (skip_unreadable): a warning pointing at the caller's line, past
    Unreadable.__call__ and .read, opened_batches' reader, grouped, predict_batches and predict."""
    warnings.warn(message, stacklevel=8)


def _dataset_names(cfg: Config) -> dict:
    """Where the weights record no names: the config's dataset's, when its files are there; else {}."""
    try:
        return build_dataset("val", cfg.data, prepare=False).class_names()
    except FileNotFoundError:
        return {}
