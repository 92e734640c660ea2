"""Every command answers bad input in one line: each entry point run as a user runs it (a subprocess),
with each kind of bad input it takes, exits 2 for a usage error (an argument, a config file, key or
value) and 1 for a failure of the work (a missing weights file or image), with exactly one line on
stderr, `error: ...`, and no traceback."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deformable_detr.data.shapes import generate

import pytest
from test_train import ROOT, TINY

PYTHON = sys.executable
TRAIN, EVAL = [PYTHON, str(ROOT / "train.py")], [PYTHON, str(ROOT / "eval.py")]
PREDICT, CONVERT, EXPORT = ([PYTHON, "-m", f"deformable_detr.{name}"] for name in ("predict", "convert", "export"))
SHAPES = [PYTHON, "-m", "deformable_detr.data.shapes"]


def bench(name):
    return [PYTHON, str(ROOT / "bench" / f"{name}.py")]


def cases(data, tmp):
    """(command, its arguments, the exit status, what the line must say)."""
    broken = tmp / "broken.yaml"
    image = data / "val2017" / "000000000001.png"
    config, nowhere = ["--config", str(TINY)], str(tmp / "nowhere.safetensors")
    data_path = f"data.path={data}"
    unknown = "override: schedule.batchsize: unknown key; did you mean schedule.batch_size?"
    wrong_type = "override: schedule.batch_size must be int, got 'abc'"
    missing_config = f"config file not found: {tmp / 'none.yaml'}"
    unparsable = f"{broken}, line 3, column 2: not valid YAML"
    missing_weights = f"{nowhere}: no such file"
    weights = ["--checkpoint", nowhere]
    return {
        "train unknown key": (TRAIN, [*config, data_path, "schedule.batchsize=4"], 2, unknown),
        "train wrong type": (TRAIN, [*config, data_path, "schedule.batch_size=abc"], 2, wrong_type),
        "train missing config": (TRAIN, ["--config", str(tmp / "none.yaml")], 2, missing_config),
        "train unparsable YAML": (TRAIN, ["--config", str(broken)], 2, unparsable),
        # each its own run directory: the cases run at once, and a run directory has one owner
        "train missing weights": (
            TRAIN,
            [*config, data_path, "--weights", nowhere, "--output-dir", "w"],
            1,
            missing_weights,
        ),
        "train missing checkpoint": (
            TRAIN,
            [*config, data_path, "--resume", nowhere, "--output-dir", "c"],
            1,
            missing_weights,
        ),
        "train batch that does not split": (
            TRAIN,
            [*config, data_path, "schedule.batch_size=6", "schedule.micro_batch_size=4"],
            2,
            "schedule.batch_size (6) is not a multiple of 1 process(es) x schedule.micro_batch_size (4)",
        ),
        "train micro-batch above the share": (
            TRAIN,
            [*config, data_path, "schedule.batch_size=4", "schedule.micro_batch_size=8"],
            2,
            "schedule.micro_batch_size (8) is above each process's share of schedule.batch_size (4 / 1 process",
        ),
        "train unknown precision": (
            TRAIN,
            [*config, data_path, "train.precision=float16"],
            2,
            "override: train.precision must be one of float32, bfloat16, got 'float16'",
        ),
        "train EMA decay out of range": (
            TRAIN,
            [*config, data_path, "train.ema_decay=1"],
            2,
            "override: train.ema_decay must be at least 0.0 and below 1.0, got 1.0",
        ),
        "train bad argument": (TRAIN, [*config, "--eval-only=yes"], 2, "--eval-only: ignored explicit argument"),
        "train settings that do not go together": (
            TRAIN,
            [*config, data_path, "model.look_forward_twice=true", "--output-dir", "lft"],
            2,
            "model.look_forward_twice needs model.with_box_refine: it looks at the refined boxes",
        ),
        "eval settings that do not go together": (
            EVAL,
            [*config, *weights, "model.backbone=swin_tiny", "model.dilation=true"],
            2,
            "model.dilation (DC5) dilates a ResNet's last stage; model.backbone swin_tiny has none",
        ),
        "predict settings that do not go together": (
            PREDICT,
            [*config, *weights, "model.mixed_selection=true", str(image)],
            2,
            "model.mixed_selection needs model.two_stage: it mixes the encoder's proposals in",
        ),
        "eval unknown key": (EVAL, [*config, *weights, "schedule.batchsize=4"], 2, unknown),
        "eval wrong type": (EVAL, [*config, *weights, "schedule.batch_size=abc"], 2, wrong_type),
        "eval missing config": (EVAL, ["--config", str(tmp / "none.yaml"), *weights], 2, missing_config),
        "eval unparsable YAML": (EVAL, ["--config", str(broken), *weights], 2, unparsable),
        "eval missing weights": (EVAL, [*config, *weights], 1, missing_weights),
        "eval bad argument": (EVAL, [*config, *weights, "--batch-size", "two"], 2, "--batch-size: invalid int"),
        "predict unknown key": (PREDICT, [*config, *weights, "schedule.batchsize=4", str(image)], 2, unknown),
        "predict wrong type": (
            PREDICT,
            [*config, *weights, str(image), "schedule.batch_size=abc"],
            2,
            wrong_type,
        ),
        "predict missing config": (
            PREDICT,
            ["--config", str(tmp / "none.yaml"), *weights, str(image)],
            2,
            missing_config,
        ),
        "predict unparsable YAML": (PREDICT, ["--config", str(broken), *weights, str(image)], 2, unparsable),
        "predict missing weights": (PREDICT, [*config, *weights, str(image)], 1, missing_weights),
        "predict missing image": (
            PREDICT,
            [*config, *weights, str(tmp / "no.png")],
            1,
            f"{tmp / 'no.png'}: no such image",
        ),
        "predict bad argument": (
            PREDICT,
            [*config, *weights, "--threshold", "high", str(image)],
            2,
            "--threshold: invalid",
        ),
        "predict folder with no images": (
            PREDICT,
            [*config, *weights, str(tmp / "empty")],
            2,
            "empty: a folder with no",
        ),
        "predict no file matches": (PREDICT, [*config, *weights, str(tmp / "*.jpeg")], 2, "*.jpeg: no file matches"),
        "predict unreadable image": (
            PREDICT,
            [*config, *weights, str(image), str(tmp / "broken.png")],
            1,
            f"{tmp / 'broken.png'}: cannot read image",
        ),
        "predict unreadable video": (
            PREDICT,
            [*config, *weights, str(tmp / "broken.mp4")],
            1,
            f"{tmp / 'broken.mp4'}: cannot read it as a video",
        ),
        "predict attention layer out of range": (
            PREDICT,
            [*config, *weights, "--attention", "--attention-layer", "2", str(image)],
            2,
            "--attention-layer 2: the model has 2 decoder layers (0 to 1)",
        ),
        "predict encoder pixel outside the image": (
            PREDICT,
            [*config, *weights, "--encoder-pixel", "64,10", str(image)],
            2,
            f"--encoder-pixel 64,10 is outside {image} (64 x 64 pixels)",
        ),
        "predict encoder pixel not a pixel": (
            PREDICT,
            [*config, *weights, "--encoder-pixel", "middle", str(image)],
            2,
            "--encoder-pixel: 'middle': expected X,Y",
        ),
        "predict batch size": (PREDICT, [*config, *weights, "--batch-size", "0", str(image)], 2, "--batch-size 0"),
        "predict hub repository not in the cache": (
            PREDICT,
            ["--checkpoint", "hf://ORG/none", str(image)],
            1,
            f"hf://ORG/none: config.json is not in the Hugging Face cache ({tmp / 'hf-cache'}) and HF_HUB_OFFLINE=1",
        ),
        "convert hub repository not in the cache": (
            CONVERT,
            ["hf://ORG/none@v2", str(tmp / "out.safetensors")],
            1,
            "hf://ORG/none@v2: config.json is not in the Hugging Face cache",
        ),
        "eval bad hub reference": (EVAL, ["--checkpoint", "hf://none"], 2, "hf://none: expected hf://ORG/NAME"),
        "convert missing weights": (
            CONVERT,
            [str(tmp / "none.pth"), str(tmp / "out.safetensors")],
            1,
            "none.pth: no such file",
        ),
        "convert bad argument": (CONVERT, [str(tmp / "none.pth")], 2, "the following arguments are required: dst"),
        "export missing weights": (
            EXPORT,
            ["--to", "torch", "--checkpoint", nowhere, str(tmp / "out.pth")],
            1,
            missing_weights,
        ),
        "export bad argument": (
            EXPORT,
            ["--to", "tflite", "--checkpoint", nowhere, str(tmp / "out.pth")],
            2,
            "--to: invalid choice: 'tflite'",
        ),
        "shapes bad argument": (
            SHAPES,
            [str(tmp / "set"), "--classes", "blob"],
            2,
            "--classes: invalid choice: 'blob'",
        ),
        "shapes bad number": (SHAPES, [str(tmp / "set"), "--train", "many"], 2, "--train: invalid int value: 'many'"),
        "bench model bad argument": (bench("model"), ["--train-size", "512by683"], 2, "'512by683': expected sizes HxW"),
        "bench memory bad argument": (bench("memory"), ["--size", "0x4"], 2, "'0x4': expected sizes HxW"),
        "bench step_parts bad argument": (bench("step_parts"), ["--size", "big"], 2, "'big': expected sizes HxW"),
        "bench predict bad argument": (bench("predict"), ["--count", "all"], 2, "--count: invalid int value"),
        "bench attention bad argument": (bench("attention"), ["--repeats", "x"], 2, "--repeats: invalid int value"),
        "bench train_step missing config": (
            bench("train_step"),
            ["--config", str(tmp / "none.yaml")],
            2,
            missing_config,
        ),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case run once, a few at a time (each is mostly a Python start and an import)."""
    tmp = tmp_path_factory.mktemp("commands")
    data = generate(tmp / "data", 2, 1, seed=1, height=(64, 64), width=(64, 64), max_size=40)
    (tmp / "empty").mkdir()
    (tmp / "broken.png").write_bytes(b"not an image")
    (tmp / "broken.mp4").write_bytes(b"not a video")
    (tmp / "broken.yaml").write_text("model:\n  backbone: resnet18\n hidden_dim: 64\n")  # line 3 is off
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    environment |= {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp / "hf-cache")}  # an empty cache, offline
    environment.pop("DEFORMABLE_DETR_TRACEBACK", None)

    def run(case):
        command, arguments, _, _ = case
        return subprocess.run(
            command + arguments, capture_output=True, text=True, cwd=tmp, env=environment, timeout=300
        )

    every = cases(data, tmp)
    with ThreadPoolExecutor(4) as pool:
        return every, dict(zip(every, pool.map(run, every.values()), strict=True))


@pytest.mark.parametrize("case_name", list(cases(Path("data"), Path("tmp"))))
def test_bad_input_is_one_line_and_its_exit_status(results, case_name):
    every, done = results
    _, _, status, said = every[case_name]
    result = done[case_name]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == status, result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    assert said in lines[0]


def test_the_traceback_is_there_when_asked_for(tmp_path):
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "DEFORMABLE_DETR_TRACEBACK": "1"}
    done = subprocess.run(
        [*EXPORT, "--to", "torch", "--checkpoint", str(tmp_path / "none.safetensors"), str(tmp_path / "out.pth")],
        capture_output=True,
        text=True,
        env=environment,
    )
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr and "FileNotFoundError" in done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"error: {tmp_path / 'none.safetensors'}: no such file"
