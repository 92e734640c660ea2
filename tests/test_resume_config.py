"""--resume compares the config with the checkpoint's: a change of what is trained (seed, batch size,
...) refuses in one line naming each key with both values, and writes nothing, unless --allow-change
names it; a change of how the run runs (workers, the data set's path spelled another way) passes
with a note. config.yaml keeps the history: the config the run started with, then each change from
the global step it holds; the checkpoints carry it, so the next resume compares with the latest."""

import shutil

from deformable_detr.config import DATA, RESUME_EFFECTS, RUNS, TRAINS, Config, config_to_dict, flat_config, load_config
from deformable_detr.errors import UsageError
from deformable_detr.training.resume_check import ResumedConfig
from deformable_detr.weights.files import read_weights

import numpy as np
import pytest
import yaml
from test_stops import assert_one_clean_line, progress_of, run_train
from test_train import TINY, weights

import train

SETTINGS = ["train.eval_every=0", "model.dropout=0.0"]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from deformable_detr.data.shapes import generate

    return generate(tmp_path_factory.mktemp("shapes"), 16, 4, seed=3, height=(64, 64), width=(64, 64), max_size=40)


@pytest.fixture(scope="module")
def trained(shapes, tmp_path_factory):
    """A run of 2 steps (tiny.yaml: seed 42, batches of 2, 2 workers), copied by `output`."""
    output = tmp_path_factory.mktemp("trained")
    run(output, f"data.path={shapes}", "train.max_steps=2")
    return output


@pytest.fixture
def output(trained, tmp_path):
    """This test's copy of the 2-step run."""
    shutil.copytree(trained, tmp_path / "run", ignore=shutil.ignore_patterns(".lock"))
    return tmp_path / "run"


def run(output, *arguments):
    train.main(["--config", str(TINY), "--output-dir", str(output), *SETTINGS, *arguments])


def contents(output) -> dict:
    return {p.name: p.read_bytes() for p in output.iterdir() if p.is_file() and p.name != ".lock"}


def refused_line(capsys, output, *arguments) -> str:
    """The one line a refused in-process run prints (exit 2), with nothing in `output` changed."""
    before = contents(output)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        run(output, *arguments)
    assert stopped.value.code == 2
    assert contents(output) == before
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_every_config_key_has_its_class_in_one_table():
    """A key added to config.py without a class in RESUME_EFFECTS fails here."""
    assert sorted(RESUME_EFFECTS) == sorted(flat_config(Config()))
    assert set(RESUME_EFFECTS.values()) == {TRAINS, RUNS, DATA}
    assert RESUME_EFFECTS["seed"] == RESUME_EFFECTS["schedule.batch_size"] == TRAINS
    assert RESUME_EFFECTS["data.num_workers"] == RESUME_EFFECTS["schedule.micro_batch_size"] == RUNS


def test_an_auto_that_is_a_setting_is_compared_and_one_set_later_once_set(tmp_path):
    """data.exif_orientation's `auto` is a setting (a change of what is trained from `displayed`); the
    micro-batch's `auto` is the memory plan's, compared only once the plan has set it."""
    recorded = load_config(None, ["data.exif_orientation=displayed", "schedule.micro_batch_size=2"])
    resumed = ResumedConfig(tmp_path / "checkpoint.safetensors", recorded, [])
    assert resumed.changes(load_config(None, ["schedule.micro_batch_size=2"])) == {
        "data.exif_orientation": ("displayed", "auto")
    }
    assert resumed.changes(load_config(None, ["data.exif_orientation=displayed"])) == {}  # micro-batch: auto
    planned = load_config(None, ["data.exif_orientation=displayed", "schedule.micro_batch_size=1"])
    assert resumed.changes(planned) == {"schedule.micro_batch_size": (2, 1)}
    with pytest.raises(UsageError, match=r"data\.exif_orientation \"displayed\" -> \"auto\""):
        resumed.check(load_config(None, ["schedule.micro_batch_size=2"]), set())


def test_a_changed_seed_and_batch_size_refuse_in_one_line_writing_nothing(shapes, output):
    before = contents(output)
    done = run_train(shapes, output, "train.max_steps=4", "seed=7", "schedule.batch_size=4", "--resume", timeout=300)
    checkpoint = output / "checkpoint.safetensors"
    assert assert_one_clean_line(done, 2) == (
        f"error: --resume: the config differs from {checkpoint}'s in what is trained: schedule.batch_size 2 -> 4, "
        "seed 42 -> 7; resume with the checkpoint's values, or change them from here on with "
        "--allow-change schedule.batch_size,seed"
    )
    assert contents(output) == before  # config.yaml, the log and the checkpoint as they were


def test_allowed_changes_run_and_config_yaml_keeps_the_history(shapes, output, capsys):
    data = f"data.path={shapes}"
    changed = ["seed=7", "schedule.batch_size=4", "--resume", "--allow-change", "seed"]
    run(output, data, "train.max_steps=3", *changed, "--allow-change", "schedule.batch_size")
    assert progress_of(output / "checkpoint.safetensors")["global_step"] == 3
    first = {
        "from_global_step": 3,
        "schedule.batch_size": [2, 4],
        "schedule.micro_batch_size": [2, 4],  # `auto`: the whole share, as the memory plan found it fits
        "train.max_steps": [2, 3],
        "seed": [42, 7],
    }
    assert (
        "--resume: the config changes from global step 3 on: schedule.batch_size 2 -> 4, schedule.micro_batch_size "
        "2 -> 4 (not what is trained), train.max_steps 2 -> 3 (not what is trained), seed 42 -> 7"
    ) in capsys.readouterr().out
    written = yaml.safe_load((output / "config.yaml").read_text())
    assert (written["seed"], written["schedule"]["batch_size"], written["changes"]) == (42, 2, [first])
    in_effect = load_config(output / "config.yaml")  # the file read as a config: its changes applied
    assert config_to_dict(in_effect) == read_weights(output / "checkpoint.safetensors").config
    assert (in_effect.seed, in_effect.schedule.batch_size) == (7, 4)

    # the same command relaunched (a preemption): the checkpoint's config is the changed one, the
    # allowed keys are as it records; only the new max_steps is added to the history
    run(output, data, "train.max_steps=4", "--allow-change", "schedule.batch_size,seed", *changed[:-2])
    written = yaml.safe_load((output / "config.yaml").read_text())
    assert written["changes"] == [first, {"from_global_step": 4, "train.max_steps": [3, 4]}]
    assert written["seed"] == 42 and load_config(output / "config.yaml").seed == 7

    # going back is a change like another, against the config in effect last
    line = refused_line(capsys, output, data, "train.max_steps=5", "--resume")
    assert line.startswith(
        f"error: --resume: the config differs from {output / 'checkpoint.safetensors'}'s in what is trained: "
        "schedule.batch_size 4 -> 2, seed 7 -> 42;"
    ), line


def test_a_changed_num_workers_passes_with_a_note_and_trains_the_same(shapes, output, tmp_path, capsys):
    run(output, f"data.path={shapes}", "train.max_steps=3", "data.num_workers=1", "--resume")
    assert (
        "--resume: the config changes from global step 3 on: data.num_workers 2 -> 1 (not what is trained), "
        "train.max_steps 2 -> 3 (not what is trained)"
    ) in capsys.readouterr().out
    assert yaml.safe_load((output / "config.yaml").read_text())["changes"] == [
        {"from_global_step": 3, "data.num_workers": [2, 1], "train.max_steps": [2, 3]}
    ]
    run(tmp_path / "straight", f"data.path={shapes}", "train.max_steps=3")
    got, want = weights(output / "checkpoint.safetensors"), weights(tmp_path / "straight" / "checkpoint.safetensors")
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_the_data_path_spelled_another_way_passes_and_another_directory_refuses(
    shapes, output, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(shapes.parent)
    run(output, f"data.path={shapes.name}", "train.max_steps=3", "--resume")
    assert f'data.path "{shapes}" -> "{shapes.name}" (not what is trained)' in capsys.readouterr().out
    around = f"{shapes}/../{shapes.name}"  # the same place, spelled another way
    run(output, f"data.path={around}", "train.max_steps=4", "--resume")
    assert f'data.path "{shapes.name}" -> "{around}" (not what is trained)' in capsys.readouterr().out

    other = tmp_path / "copy"
    shutil.copytree(shapes, other)
    line = refused_line(capsys, output, f"data.path={other}", "train.max_steps=5", "--resume")
    assert line.startswith(
        f"error: --resume: the config differs from {output / 'checkpoint.safetensors'}'s in what is trained: "
        f'data.path "{around}" -> "{other}"; '
    ), line


def test_a_config_with_the_old_key_is_read_with_a_note(tmp_path, capsys):
    """data.coco_path, data.path's old name (in configs and checkpoints written before), is read as data.path."""
    from deformable_detr.config import load_config

    old = tmp_path / "old.yaml"
    old.write_text("data:\n  coco_path: data/elsewhere\n")
    assert load_config(old).data.path == "data/elsewhere"
    assert load_config(None, ["data.coco_path=there"]).data.path == "there"
    assert load_config(None, ["data.path=here", "data.coco_path=there"]).data.path == "there"  # the later wins
    both = load_config(None, [], base={"data": {"path": "new", "coco_path": "old"}}, base_source="a checkpoint")
    assert both.data.path == "new"
    err = capsys.readouterr().err
    assert f"{old}: data.coco_path is read as data.path (its name now)" in err
    assert "a checkpoint: data.coco_path is read as data.path (its name now)" in err


def test_allow_change_names_a_key_that_changed_and_goes_with_resume(shapes, output, capsys):
    with pytest.raises(UsageError, match=r"^--allow-change sed: unknown key; did you mean seed\?$"):
        train.parse_args(["--config", str(TINY), "--resume", "--allow-change", "sed"])
    with pytest.raises(UsageError, match=r"^argument --allow-change: expected one argument"):
        train.parse_args(["--config", str(TINY), "--resume", "--allow-change"])
    with pytest.raises(UsageError, match=r"^--allow-change: only with --resume \(it names the keys"):
        train.parse_args(["--config", str(TINY), "--allow-change", "seed"])
    line = refused_line(
        capsys, output, f"data.path={shapes}", "seed=7", "--resume", "--allow-change", "seed,optimizer.lr"
    )
    checkpoint = output / "checkpoint.safetensors"
    assert line == f"error: --allow-change optimizer.lr: as in {checkpoint} (optimizer.lr 0.001): nothing to allow"


def test_config_yaml_changes_are_read_in_order_and_checked(tmp_path):
    config = tmp_path / "config.yaml"
    changes = [
        {"from_global_step": 3, "seed": [42, 7], "schedule.batch_size": [2, 4]},
        {"from_global_step": 9, "seed": [7, 8]},
    ]
    config.write_text(yaml.safe_dump({"seed": 42, "schedule": {"batch_size": 2}, "changes": changes}))
    read = load_config(config)
    assert (read.seed, read.schedule.batch_size) == (8, 4)
    config.write_text(yaml.safe_dump({"seed": 42, "changes": [{"from_global_step": 3, "seed": 7}]}))
    with pytest.raises(UsageError) as bad:
        load_config(config)
    assert str(bad.value) == (
        f"{config}: changes: expected a list of {{from_global_step: N, section.key: [old, new], ...}}, "
        "got {'from_global_step': 3, 'seed': 7}"
    )
    config.write_text(yaml.safe_dump({"changes": [{"from_global_step": 3, "sed": [1, 2]}]}))
    with pytest.raises(UsageError, match=r": changes from global step 3: sed: unknown key; did you mean seed\?$"):
        load_config(config)
