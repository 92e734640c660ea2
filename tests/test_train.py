"""Training: the loss goes down, a resumed run equals an uninterrupted one bit for bit, two processes
equal one on the combined batch, and a zero sampling_offsets gradient stops the first step."""

import json
import subprocess
import sys
import types
from pathlib import Path

from deformable_detr.data.shapes import generate
from deformable_detr.training.optimizer import set_epoch_learning_rates
from deformable_detr.training.trainer import Trainer

import mlx.core as mx
import numpy as np
import pytest

import train

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "fixtures" / "tiny.yaml"
TINY_IMAGES = [(80, 64)]  # (width, height) of the tests' synthetic batches: the trainer's memory plan


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """16 train images of 64 x 64 (no padding, so batches of any split agree), 4 val."""
    return generate(tmp_path_factory.mktemp("shapes"), 16, 4, seed=3, height=(64, 64), width=(64, 64), max_size=40)


def run(shapes, output_dir, *overrides, resume=None, weights=None):
    argv = ["--config", str(TINY), "--output-dir", str(output_dir), f"data.path={shapes}", *overrides]
    train.main(argv + (["--resume", str(resume)] if resume else []) + (["--weights", str(weights)] if weights else []))
    return output_dir / "checkpoint.safetensors"


def weights(checkpoint):
    return {k: np.array(v) for k, v in mx.load(str(checkpoint)).items()}


def logged(output_dir, key: str):
    """The value of `key` in the first log.jsonl record holding it (the splits' records come first)."""
    records = [json.loads(line) for line in (output_dir / "log.jsonl").read_text().splitlines()]
    return next(r[key] for r in records if key in r)


def epoch_losses(output_dir):
    records = [json.loads(line) for line in (output_dir / "log.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "epoch_steps" in r]


def test_a_few_epochs_lower_the_loss(shapes, tmp_path):
    run(shapes, tmp_path, "schedule.epochs=4", "model.dropout=0.0")
    losses = epoch_losses(tmp_path)
    assert len(losses) == 4
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize(
    "split, stopped_at",
    [((), (0, 5, 5)), (("schedule.batch_size=4", "schedule.micro_batch_size=2"), (1, 1, 5))],
    ids=["batch of 2", "2 micro-batches of 2"],
)
def test_resume_is_bit_for_bit(shapes, tmp_path, split, stopped_at):
    """5 steps, stop (mid-epoch), resume for 4 more == 9 steps uninterrupted (model and optimizer
    state); dropout on, so the random draws must line up too; with gradients accumulated too."""
    stopped = run(shapes, tmp_path / "a", "train.max_steps=5", *split)
    progress = json.loads(mx.load(str(stopped), return_metadata=True)[1]["progress"])
    assert (progress["epoch"], progress["step"], progress["global_step"]) == stopped_at
    resumed = run(shapes, tmp_path / "b", "train.max_steps=9", *split, resume=stopped)
    straight = run(shapes, tmp_path / "c", "train.max_steps=9", *split)
    got, want = weights(resumed), weights(straight)
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_zero_sampling_offsets_gradient_stops_the_first_step(shapes, tmp_path, monkeypatch):
    """Reproduce the failure the check exists for: locations cut from the graph (what a gather-based
    sampler without a grid gradient amounts to)."""
    import kernels
    from deformable_detr.models import ms_deform_attn as module

    def blind(value, shapes_, start, locations, weights, **kwargs):
        return kernels.ms_deform_attn(value, shapes_, start, mx.stop_gradient(locations), weights, **kwargs)

    monkeypatch.setattr(
        module,
        "kernels",
        types.SimpleNamespace(ms_deform_attn=blind, softmax=kernels.softmax, masked_rows=kernels.masked_rows),
    )
    with pytest.raises(
        SystemExit,
        match=r"^error: sampling_offsets gradient is zero .*encoder\.layers\.0\.self_attn\.sampling_offsets = 0\.0",
    ):
        run(shapes, tmp_path / "a", "train.max_steps=1")
    run(shapes, tmp_path / "b", "train.max_steps=1", "train.check_sampling_offsets=false")  # the switch
    norms = logged(tmp_path / "b", "sampling_offsets_grad_norms")
    assert norms and all(v == 0.0 for v in norms.values())


def test_first_step_logs_every_sampling_offsets_gradient(shapes, tmp_path):
    run(shapes, tmp_path, "train.max_steps=1")
    norms = logged(tmp_path, "sampling_offsets_grad_norms")
    assert sorted(norms) == [
        "transformer.decoder.layers.0.cross_attn.sampling_offsets",
        "transformer.decoder.layers.1.cross_attn.sampling_offsets",
        "transformer.encoder.layers.0.self_attn.sampling_offsets",
    ]
    assert all(np.isfinite(v) and v > 0 for v in norms.values())


def first_step(output_dir) -> dict:
    return next(json.loads(line) for line in (output_dir / "log.jsonl").read_text().splitlines() if '"step": 1' in line)


def test_two_processes_and_two_micro_batches_equal_one_batch(shapes, tmp_path):
    """A batch of 4 in one step: in one piece, as 2 micro-batches of 2 (gradients accumulated), and
    over 2 processes of 2 (data parallel over the ring backend on loopback). Same images (the first
    4 of the epoch's order), the same losses, the same update."""
    one_step = ["train.max_steps=1", "schedule.batch_size=4", "model.dropout=0.0"]
    single = run(shapes, tmp_path / "single", *one_step, "schedule.micro_batch_size=4")
    accumulated = run(shapes, tmp_path / "accumulated", *one_step, "schedule.micro_batch_size=2")
    launcher = Path(sys.executable).parent / "mlx.launch"  # installed with mlx, beside this python
    command = [
        str(launcher),
        "--backend",
        "ring",
        "--hosts",
        "127.0.0.1",
        "-n",
        "2",
        "--starting-port",
        "47311",
        sys.executable,
        str(ROOT / "train.py"),
        "--config",
        str(TINY),
        "--output-dir",
        str(tmp_path / "double"),
        f"data.path={shapes}",
        *one_step,
        "schedule.micro_batch_size=2",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    want, want_losses = weights(single), first_step(tmp_path / "single")
    for other in (accumulated, tmp_path / "double" / "checkpoint.safetensors"):
        got, losses = weights(other), first_step(other.parent)
        for key in ("loss", "loss_ce", "loss_bbox", "loss_giou", "loss_ce_0", "grad_norm"):
            assert losses[key] == pytest.approx(want_losses[key], rel=1e-5), (other, key)
        # Adam's first step moves each parameter by about lr * g / |g|: where a gradient entry is near
        # zero, another summation order can tip it by a fraction of lr (1e-3).
        for key in want:
            if key.startswith("model."):
                np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5, err_msg=f"{other}: {key}")


def test_parameter_groups_frozen_layers_and_lr_drop():
    """The authors' recipe: backbone at lr_backbone (stem and layer1 frozen), sampling_offsets and
    reference_points at lr x 0.1, the rest at lr; every rate x 0.1 from epoch lr_drop on."""
    from deformable_detr import build_model, load_config

    from mlx.utils import tree_flatten

    small = ["data.scales=[64]", "data.max_size=64", "data.crop_resize=[64]", "schedule.batch_size=2"]  # a quick plan
    cfg = load_config(None, ["model.backbone=resnet18", "model.enc_layers=1", "model.dec_layers=1", *small])
    model = build_model(cfg)
    optimizer = Trainer.from_config(model, cfg, TINY_IMAGES).optimizer
    trainable = dict(tree_flatten(model.trainable_parameters()))
    assert not any(k.startswith(("backbone.0.body.conv1", "backbone.0.body.layer1")) for k in trainable)
    assert not any(k.endswith(("running_mean", "running_var")) or ".bn" in k for k in trainable)  # frozen BN
    assert "backbone.0.body.layer2.0.conv1.weight" in trainable

    groups = optimizer._split_dictionary(trainable)
    assert all(k.startswith("backbone.0") for k, _ in tree_flatten(groups[0]))
    assert {k for k, _ in tree_flatten(groups[1])} == {
        "transformer.reference_points.weight",
        "transformer.reference_points.bias",
        "transformer.encoder.layers.0.self_attn.sampling_offsets.weight",
        "transformer.encoder.layers.0.self_attn.sampling_offsets.bias",
        "transformer.decoder.layers.0.cross_attn.sampling_offsets.weight",
        "transformer.decoder.layers.0.cross_attn.sampling_offsets.bias",
    }
    assert "transformer.level_embed" in dict(tree_flatten(groups[2]))
    for epoch, factor in [(0, 1.0), (39, 1.0), (40, 0.1)]:
        set_epoch_learning_rates(optimizer, cfg, epoch)
        rates = [o.learning_rate.item() for o in optimizer.optimizers]
        np.testing.assert_allclose(rates, [2e-5 * factor, 2e-5 * factor, 2e-4 * factor], rtol=1e-6)


def test_weights_must_belong_to_the_model(shapes, tmp_path):
    weights = tmp_path / "w.safetensors"
    mx.save_safetensors(str(weights), {"backbone.0.body.conv2.weight": mx.zeros((2, 2))})
    with pytest.raises(SystemExit, match=r"backbone\.0\.body\.conv2\.weight is not a parameter of this config's model"):
        run(shapes, tmp_path / "o", weights=weights)
    mx.save_safetensors(str(weights), {"backbone.0.body.conv1.weight": mx.zeros((2, 2))})
    with pytest.raises(SystemExit, match=r"conv1\.weight has shape \(2, 2\); the model's is \(64, 7, 7, 3\)"):
        run(shapes, tmp_path / "o", weights=weights)


def test_accumulated_gradients_equal_the_whole_batch(monkeypatch):
    """The trainer's step over micro-batches of 2 and of 1 against one of 4: the losses and every
    gradient (images of one size, targets with different numbers of boxes, so that normalising each
    micro-batch by its own boxes would show)."""
    from deformable_detr import build_model, load_config

    from mlx.utils import tree_flatten

    cfg = load_config(
        TINY, ["model.dropout=0.0", "optimizer.lr_backbone=1e-5", "optimizer.freeze_stem_and_layer1=false"]
    )
    mx.random.seed(0)
    trainer = Trainer.from_config(build_model(cfg), cfg, TINY_IMAGES)
    rng = np.random.default_rng(0)
    images = rng.standard_normal((4, 64, 64, 3)).astype(np.float32)
    mask = np.zeros((4, 64, 64), bool)
    targets = [
        {"labels": rng.integers(1, 6, n), "boxes": rng.uniform(0.2, 0.4, (n, 4)).astype(np.float32)}
        for n in (1, 4, 2, 3)
    ]
    captured = []
    monkeypatch.setattr(Trainer, "_update", lambda self, grads, total, losses: captured.append((grads, losses)))

    def step(size):
        trainer.step([(images[i : i + size], mask[i : i + size], targets[i : i + size]) for i in range(0, 4, size)])
        grads, losses = captured.pop()
        return dict(tree_flatten(grads)), {k: v.item() for k, v in losses.items()}

    want_grads, want_losses = step(4)
    assert any(k.startswith("backbone.0.body.conv1") for k in want_grads)
    for size in (2, 1):
        grads, losses = step(size)
        for key, want in want_losses.items():  # the logged class error is a mean over images, not boxes
            assert losses[key] == pytest.approx(want, rel=1e-5) or key.startswith("class_error"), (size, key)
        for key, want in want_grads.items():
            scale = float(np.abs(np.array(want)).max())
            np.testing.assert_allclose(
                np.array(grads[key]), np.array(want), atol=1e-5 * scale, err_msg=f"{size}: {key}"
            )


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda path: path.stem)
def test_the_batch_alone_can_be_overridden_in_every_shipped_config(config):
    """No shipped config pins a micro-batch that a smaller batch cannot take: it follows the share."""
    from deformable_detr import load_config
    from deformable_detr.training.trainer import process_share

    for batch in (1, 2, 6):
        cfg = load_config(config, [f"schedule.batch_size={batch}"])
        assert cfg.schedule.micro_batch_size == "auto"
        assert process_share(cfg, 1) == batch


def test_the_quick_starts_config_trains_on_a_batch_of_2(shapes, tmp_path, capsys):
    """`schedule.batch_size=2` alone: the memory plan makes the micro-batch the whole share, 2, and the
    checkpoint's config records it."""
    from deformable_detr.weights.files import read_weights

    argv = ["--config", str(ROOT / "configs" / "shapes.yaml"), "--output-dir", str(tmp_path)]
    train.main([*argv, f"data.path={shapes}", "schedule.batch_size=2", "train.max_steps=1", "train.eval_every=0"])
    assert "2 images a step: 1 process(es) x 1 of 2" in capsys.readouterr().out
    saved = read_weights(tmp_path / "checkpoint.safetensors")
    assert saved.progress["global_step"] == 1 and saved.config["schedule"]["micro_batch_size"] == 2
