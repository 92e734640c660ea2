"""`train.early_stop_patience` N: the run ends after N evaluations without a higher val AP, with a line
saying why and where the best checkpoint is, exit 0; the count survives a resume."""

import json
import os
import subprocess
import sys

from deformable_detr.data.shapes import generate
from deformable_detr.training import engine
from deformable_detr.training.engine import Progress
from deformable_detr.weights.files import read_weights

import pytest
from test_train import ROOT, TINY, weights

import train


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """8 train images (4 steps an epoch), 4 val."""
    return generate(tmp_path_factory.mktemp("shapes"), 8, 4, seed=5, height=(64, 64), width=(64, 64), max_size=40)


def arguments(shapes, output, *overrides):
    return ["--config", str(TINY), "--output-dir", str(output), f"data.path={shapes}", *overrides]


def evaluations(output) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]
    return [(r["epoch"], r["eval"]["AP"]) for r in records if "eval" in r]


def test_a_run_whose_ap_stops_rising_stops_after_patience_evaluations(shapes, tmp_path):
    """Learning rates 0: the weights, and so the AP, stay as they are. The first evaluation is the
    best; the next two are not higher: the run stops before epoch 3 of 10, exit 0."""
    output = tmp_path / "run"
    command = [sys.executable, str(ROOT / "train.py"), *arguments(shapes, output)]
    settings = ["schedule.epochs=10", "optimizer.lr=0", "optimizer.lr_backbone=0", "train.early_stop_patience=2"]
    done = subprocess.run(
        [*command, *settings], capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    evaluated = evaluations(output)
    assert [epoch for epoch, _ in evaluated] == [0, 1, 2] and len({ap for _, ap in evaluated}) == 1
    progress = read_weights(output / "checkpoint.safetensors").progress
    assert (progress["epoch"], progress["global_step"], progress["best_epoch"]) == (3, 12, 0)
    assert progress["evaluations_since_best"] == 2
    best = read_weights(output / "checkpoint_best.safetensors").progress
    assert (best["epoch"], best["global_step"], best["evaluations_since_best"]) == (1, 4, 0)
    assert (
        f"stopped early: no higher val AP in 2 evaluations (train.early_stop_patience); the best, AP "
        f"{evaluated[0][1]:.3f} after epoch 0: {output / 'checkpoint_best.safetensors'}"
    ) in done.stdout
    assert f"done: 12 steps; checkpoint {output / 'checkpoint.safetensors'}" in done.stdout


def with_ap(monkeypatch, sequence: list):
    """engine.evaluate, whose AP is the next of `sequence` (the rest of the evaluation real)."""
    evaluate, calls = engine.evaluate, []

    def evaluate_with_ap(*args, **kwargs):
        evaluation = evaluate(*args, **kwargs)
        evaluation.stats["AP"] = sequence[len(calls)]
        calls.append(evaluation)
        return evaluation

    monkeypatch.setattr(engine, "evaluate", evaluate_with_ap)
    return calls


def test_the_best_checkpoint_is_the_evaluation_of_highest_ap(shapes, tmp_path, monkeypatch, capsys):
    """AP 0.1, 0.3 (the best), 0.2, 0.3 (not higher): with a patience of 2, no epoch 4."""
    with_ap(monkeypatch, [0.1, 0.3, 0.2, 0.3, 0.5, 0.6])
    train.main(arguments(shapes, tmp_path, "schedule.epochs=6", "train.early_stop_patience=2"))
    assert evaluations(tmp_path) == [(0, 0.1), (1, 0.3), (2, 0.2), (3, 0.3)]
    best, last = tmp_path / "checkpoint_best.safetensors", tmp_path / "checkpoint.safetensors"
    assert read_weights(best).progress["global_step"] == 8 and read_weights(last).progress["global_step"] == 16
    assert f"the best, AP 0.300 after epoch 1: {best}" in capsys.readouterr().out
    assert weights(best).keys() == weights(last).keys()
    assert any((weights(best)[k] != weights(last)[k]).any() for k in weights(last))  # trained on after it


def test_a_resumed_run_keeps_counting(shapes, tmp_path, monkeypatch):
    """Two evaluations (the second not higher), stopped by max_steps; resumed, the third is the second
    without a higher AP: it stops there, not after two more."""
    with_ap(monkeypatch, [0.3, 0.2, 0.1, 0.1, 0.1])
    settings = ["schedule.epochs=6", "train.early_stop_patience=2"]
    train.main(arguments(shapes, tmp_path, *settings, "train.max_steps=8"))
    saved = Progress.from_checkpoint(read_weights(tmp_path / "checkpoint.safetensors").progress)
    assert (saved.epoch, saved.best_epoch, saved.evaluations_since_best) == (2, 0, 1)
    train.main(arguments(shapes, tmp_path, *settings, "--resume"))
    assert [epoch for epoch, _ in evaluations(tmp_path)] == [0, 1, 2]
    assert read_weights(tmp_path / "checkpoint.safetensors").progress["epoch"] == 3


def test_patience_without_evaluations_is_a_usage_error(shapes, tmp_path):
    with pytest.raises(SystemExit) as stopped:
        train.main(arguments(shapes, tmp_path, "train.early_stop_patience=2", "train.eval_every=0"))
    assert stopped.value.code == 2
    assert not (tmp_path / "config.yaml").exists()
