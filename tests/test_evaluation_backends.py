"""evaluation.backend: faster-coco-eval gives pycocotools' 12 numbers, per-class table, precision and
recall arrays and printed summary (to 1e-12) on a shapes val and on COCO-shaped data with crowd boxes,
empty images, every area range, category ids with gaps and more than 100 detections an image; `auto`
takes it where installed."""

import contextlib
import copy
import io
import sys

from deformable_detr import load_config
from deformable_detr.data.in_memory import coco_from_dict
from deformable_detr.data.shapes import generate
from deformable_detr.errors import MissingExtra, UsageError
from deformable_detr.inference import evaluation_backends
from deformable_detr.inference.evaluation import PER_CLASS_NAMES, STAT_NAMES, coco_evaluator, summary
from deformable_detr.inference.evaluation_backends import resolve_backend

import numpy as np
import pytest

pytest.importorskip("faster_coco_eval", reason="faster-coco-eval is not installed (pip install -e '.[fast-eval]')")


def coco_shaped(seed=0, images=60):
    """Ground truth as COCO's: 640 x 480 images, categories 1, 2, 3, 7, 90 (7 has no boxes), boxes of
    every area range, areas below the boxes' (COCO's are the masks'), crowd boxes, a quarter of the
    images empty; detections: the boxes jittered, some of another class, false positives (on the empty
    images too), tied scores, and 150 on some images (pycocotools keeps the best 100)."""
    rng = np.random.default_rng(seed)
    categories, with_boxes = [1, 2, 3, 7, 90], [1, 2, 3, 90]
    data = {"images": [], "annotations": [], "categories": [{"id": c, "name": f"class {c}"} for c in categories]}
    detections = []
    for image_id in range(1, images + 1):
        data["images"].append({"id": image_id, "file_name": f"{image_id}.jpg", "width": 640, "height": 480})
        for _ in range(0 if image_id % 4 == 0 else int(rng.integers(1, 12))):
            side = float(rng.choice([rng.uniform(4, 31), rng.uniform(33, 95), rng.uniform(97, 300)]))
            w, h = side * rng.uniform(0.6, 1.4), side * rng.uniform(0.6, 1.4)
            x, y = rng.uniform(0, 640 - w), rng.uniform(0, 480 - h)
            crowd = int(rng.uniform() < 0.08)
            category = int(rng.choice(with_boxes))
            data["annotations"].append(
                {
                    "id": len(data["annotations"]) + 1,
                    "image_id": image_id,
                    "category_id": category,
                    "bbox": [x, y, w, h],
                    "area": w * h * rng.uniform(0.5, 1.0),
                    "iscrowd": crowd,
                }
            )
            for _ in range(int(rng.integers(0, 3))):
                label = int(rng.choice(categories)) if rng.uniform() < 0.15 else category
                box = [x + rng.normal(0, 0.1 * w), y + rng.normal(0, 0.1 * h), w * rng.uniform(0.7, 1.3), h]
                detections.append({"image_id": image_id, "category_id": label, "bbox": box, "score": rng.uniform()})
        for _ in range(150 if image_id % 7 == 0 else 3):
            box = [float(v) for v in [*rng.uniform(0, 400, 2), *rng.uniform(5, 200, 2)]]
            score = float(rng.choice([0.25, 0.5, rng.uniform()]))  # ties
            detections.append(
                {"image_id": image_id, "category_id": int(rng.choice(categories)), "bbox": box, "score": score}
            )
    return coco_from_dict(data), detections


def shapes_val(tmp_path):
    """The shapes set's val split as training reads it, and detections around its boxes."""
    from deformable_detr.data import CocoDetection

    dataset = CocoDetection(generate(tmp_path, 1, 30, seed=4), "val")
    rng = np.random.default_rng(1)
    detections = []
    for a in dataset.coco.anns.values():
        x, y, w, h = a["bbox"]
        for _ in range(2):
            label = int(rng.integers(1, 6)) if rng.uniform() < 0.2 else a["category_id"]
            box = [x + rng.normal(0, 2), y + rng.normal(0, 2), w * rng.uniform(0.8, 1.2), h * rng.uniform(0.8, 1.2)]
            detections.append({"image_id": a["image_id"], "category_id": label, "bbox": box, "score": rng.uniform()})
    return dataset.coco, detections


def evaluated(coco_gt, detections, backend):
    """-> (the evaluator, its summary dict, the summary lines it printed)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        evaluator = coco_evaluator(coco_gt, copy.deepcopy(detections), verbose=True, backend=backend)
    lines = [line for line in printed.getvalue().splitlines() if line.startswith(" Average")]
    return evaluator, summary(evaluator, coco_gt), lines


@pytest.mark.parametrize("data", ["shapes val", "COCO-shaped"])
def test_faster_coco_eval_equals_pycocotools(data, tmp_path):
    coco_gt, detections = shapes_val(tmp_path) if data == "shapes val" else coco_shaped()
    reference, want, want_lines = evaluated(coco_gt, detections, "pycocotools")
    faster, got, got_lines = evaluated(coco_gt, detections, "faster_coco_eval")
    assert type(faster).__module__.startswith("faster_coco_eval")
    assert 0.05 < want["AP"] < 0.95  # neither empty nor perfect
    for name in STAT_NAMES:
        assert got[name] == pytest.approx(want[name], abs=1e-12), name
    assert got["per_class"].keys() == want["per_class"].keys()
    for category, values in want["per_class"].items():
        assert got["per_class"][category]["gt"] == values["gt"]
        for name in PER_CLASS_NAMES:
            assert got["per_class"][category][name] == pytest.approx(values[name], abs=1e-12), (category, name)
    for array in ("precision", "recall"):
        np.testing.assert_allclose(faster.eval[array], reference.eval[array], rtol=0, atol=1e-12, err_msg=array)
    assert got_lines == want_lines and len(want_lines) == 12


def test_coco_shaped_data_has_what_it_should():
    """The cases the comparison above is meant to cover are there."""
    coco_gt, detections = coco_shaped()
    annotations = list(coco_gt.anns.values())
    areas = np.array([a["area"] for a in annotations])
    assert (areas < 32**2).any() and ((areas > 32**2) & (areas < 96**2)).any() and (areas > 96**2).any()
    assert sum(a["iscrowd"] for a in annotations) >= 5
    empty = set(coco_gt.imgs) - {a["image_id"] for a in annotations}
    assert len(empty) == 15 and empty & {d["image_id"] for d in detections}
    assert max(np.unique([d["image_id"] for d in detections], return_counts=True)[1]) > 100
    assert not coco_gt.getAnnIds(catIds=[7]) and any(d["category_id"] == 7 for d in detections)


def test_auto_takes_faster_coco_eval_where_installed(monkeypatch):
    assert resolve_backend("auto") == "faster_coco_eval"
    assert resolve_backend("pycocotools") == "pycocotools"
    monkeypatch.setattr(evaluation_backends.importlib.util, "find_spec", lambda name: None)
    assert resolve_backend("auto") == "pycocotools"
    monkeypatch.setitem(sys.modules, "faster_coco_eval", None)  # as if not installed
    with pytest.raises(
        MissingExtra, match=r'evaluation.backend faster_coco_eval needs faster_coco_eval, in the "fast-eval"'
    ):
        resolve_backend("faster_coco_eval")


def test_an_unknown_backend_is_a_usage_error():
    with pytest.raises(UsageError, match="evaluation.backend must be one of auto, pycocotools, faster_coco_eval"):
        load_config(None, ["evaluation.backend=fast"])
