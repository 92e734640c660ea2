"""OpenVINO on the exported ONNX file, as written (no conversion step), at f32 precision, against the
MLX model on the same padded batch: small models of every variant (grid_sample too for two), the
post-processing graph. Held to export_models.assert_close's 1e-4 of the largest value, as the
onnxruntime tests; OpenVINO 2026.4 measures at most 9e-7 here.

OpenVINO runs in a process of its own started without ONEDNN_MAX_CPU_ISA: its CPU plugin (2026.4)
chooses its kernels from the CPU's own flags while its bundled oneDNN obeys the cap, and crashes
(a segmentation fault) when an AVX-512 CPU is capped to AVX2, as the capped test runs do
(test_instruction_sets.py). A real AVX2 CPU has no such mismatch; the file is the same either way."""

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
from PIL import Image

onnx = pytest.importorskip("onnx", reason="exporting to ONNX needs the onnx package (the onnx and dev extras)")
ov = pytest.importorskip("openvino", reason="running the file in OpenVINO needs the openvino package (the dev extra)")

from deformable_detr.deploy.inputs import canvas_inputs  # noqa: E402
from deformable_detr.deploy.onnx.detector import build_graph  # noqa: E402

import mlx.core as mx  # noqa: E402
from export_models import (  # noqa: E402
    CANVAS,
    SIZES,
    VARIANTS,
    assert_close,
    assert_post_processed,
    padded_batch,
    small_model,
    weights_of,
)

# Where the CPU has bfloat16 instructions OpenVINO's default runs the graph in bf16 (the small r50's
# logits off by 0.04 of 7): the comparison with ours is at f32, as the docs tell a user to compile it.
F32 = {"INFERENCE_PRECISION_HINT": "f32"}


def _run(path: str, inputs: dict) -> dict:
    """In OpenVINO's process: the file compiled by its CPU plugin at f32, run once; its outputs by name."""
    outputs = ov.Core().compile_model(path, "CPU", F32)(inputs)
    return {name: np.asarray(value) for port, value in outputs.items() for name in port.get_names()}


@pytest.fixture(scope="module")
def openvino():
    """run(graph, path, inputs): the graph written to `path` as `export --to onnx` writes it, run in
    OpenVINO's process (started without ONEDNN_MAX_CPU_ISA: the module's docstring)."""
    capped = os.environ.pop("ONEDNN_MAX_CPU_ISA", None)
    try:
        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        pool.submit(int).result()  # started now, with the environment as it is here
    finally:
        if capped is not None:
            os.environ["ONEDNN_MAX_CPU_ISA"] = capped

    def run(graph, path, inputs):
        onnx.save(graph, str(path))
        return pool.submit(_run, str(path), inputs).result()

    with pool:
        yield run


CASES = [(v, "gather") for v in VARIANTS] + [("r50", "grid_sample"), ("r50_two_stage", "grid_sample")]


@pytest.mark.parametrize("variant,sampler", CASES)
def test_openvino_gives_our_logits_and_boxes(variant, sampler, openvino, tmp_path):
    model, cfg = small_model(variant)
    images, mask = padded_batch()
    graph = build_graph(weights_of(model), cfg.model, CANVAS, batch=len(SIZES), sampler=sampler)
    inputs = {"pixel_values": images.transpose(0, 3, 1, 2).copy(), "pixel_mask": (~mask).astype(np.int64)}
    outputs = openvino(graph, tmp_path / "model.onnx", inputs)

    ours = model(mx.array(images), mx.array(mask))
    for i, size in enumerate(SIZES):
        assert_close(ours["pred_logits"][i], outputs["logits"][i], f"logits of the {size} image")
        assert_close(ours["pred_boxes"][i], outputs["pred_boxes"][i], f"boxes of the {size} image")


@pytest.mark.parametrize("variant", ["r50", "r50_two_stage"])
def test_openvino_postprocess_graph_gives_post_process_detections(variant, openvino, tmp_path):
    model, cfg = small_model(variant)
    rng = np.random.default_rng(2)
    photos = [Image.fromarray(rng.integers(0, 256, (h * 3, w * 3, 3), np.uint8)) for h, w in SIZES]
    inputs = canvas_inputs(photos, CANVAS, size=64, max_size=100)
    target_sizes = np.array([[p.height, p.width] for p in photos], np.int64)
    graph = build_graph(weights_of(model), cfg.model, CANVAS, batch=len(photos), postprocess=True)
    outputs = openvino(graph, tmp_path / "model.onnx", {**inputs, "target_sizes": target_sizes})

    exported = tuple(outputs[name] for name in ("scores", "labels", "boxes"))
    assert_post_processed(model, inputs, target_sizes, exported)
