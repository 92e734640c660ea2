"""The commands as a user meets them: docs/commands.md is what the parsers say; every command's --help
names it as it was started (the console script, or `python -m`); the old spellings (`export SRC DST`,
`predict --set KEY=VALUE`) still work, each with its one-line note, once a run."""

import importlib
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deformable_detr.commands import COMMANDS, cli
from deformable_detr.commands.reference import command_reference, shown
from deformable_detr.errors import UsageError
from deformable_detr.export import main as export_main
from deformable_detr.predict import main as predict_main

import pytest
from PIL import Image
from test_predict import tiny  # noqa: F401  (the fixture: the tiny config's model, saved as converted weights)

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "commands.md"
REGENERATE = "python -m deformable_detr.commands.reference > docs/commands.md"


def test_the_page_is_what_the_parsers_say():
    assert PAGE.read_text() == command_reference(), f"docs/commands.md differs from the parsers: run `{REGENERATE}`"


def console_script() -> str:
    script = Path(sys.executable).parent / cli.CONSOLE_SCRIPT
    found = str(script) if script.exists() else shutil.which(cli.CONSOLE_SCRIPT)
    if found is None:
        pytest.skip(f"no {cli.CONSOLE_SCRIPT} console script beside {sys.executable} or on the PATH (pip install -e .)")
    return found


def test_every_help_names_the_command_as_it_was_started(tmp_path):
    script = console_script()
    started = {}
    for command in COMMANDS:
        started[(command, "console script")] = ([script, command, "--help"], f"usage: {cli.CONSOLE_SCRIPT} {command} ")
        module = f"deformable_detr.{command}"
        started[(command, "python -m")] = ([sys.executable, "-m", module, "--help"], f"usage: python -m {module} ")
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}

    def run(argv):
        return subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=environment, timeout=300)

    with ThreadPoolExecutor(4) as pool:
        done = dict(zip(started, pool.map(run, [argv for argv, _ in started.values()]), strict=True))
    for (command, how), result in done.items():
        assert result.returncode == 0, f"{command} --help ({how}): {result.stderr[-2000:]}"
        assert result.stdout.startswith(started[command, how][1]), f"{command} ({how}): {result.stdout[:200]}"
        parser = importlib.import_module(f"deformable_detr.commands.{command}").build_parser()
        for action in shown(parser):
            assert all(option in result.stdout for option in action.option_strings), (command, action.dest)


def image_in(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (80, 64), (120, 90, 60)).save(folder / "picture.png")
    return folder / "picture.png"


def test_predict_set_is_the_old_spelling_of_a_positional_override(tiny, tmp_path, capsys, monkeypatch):  # noqa: F811
    argv, _ = tiny
    image = image_in(tmp_path / "in")
    settings = ["data.val_size=64", "data.max_size=64"]
    monkeypatch.setattr(cli, "_noted", set())
    predict_main([*argv, "--threshold", "0", "--output-dir", str(tmp_path / "new"), str(image), *settings])
    assert "note:" not in capsys.readouterr().err
    old = [*argv, "--threshold", "0", "--output-dir", str(tmp_path / "old"), "--set", settings[0]]
    predict_main([*old, f"--set={settings[1]}", str(image)])
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert notes == [
        f"note: `predict --set KEY=VALUE` is the old spelling, kept for one release; now: "
        f"`{cli.OLD_SPELLINGS['predict --set KEY=VALUE']}`"
    ]
    answers = [json.loads((tmp_path / way / "picture.json").read_text()) for way in ("new", "old")]
    assert answers[0] == answers[1] and answers[0]  # threshold 0: every query and class


def test_export_src_dst_is_the_old_spelling_of_export_checkpoint(tiny, tmp_path, capsys, monkeypatch):  # noqa: F811
    argv, _ = tiny
    config, weights = argv[1], argv[3]
    monkeypatch.setattr(cli, "_noted", set())
    export_main(["--to", "mlx", "--checkpoint", weights, str(tmp_path / "new.mlxfn"), "--config", config])
    assert "note:" not in capsys.readouterr().err
    export_main(["--to", "mlx", weights, str(tmp_path / "old.mlxfn"), "--config", config, "data.val_size=64"])
    said = capsys.readouterr()
    assert [line for line in said.err.splitlines() if line.startswith("note:")] == [
        "note: `export SRC DST` is the old spelling, kept for one release; now: `export --checkpoint SRC DST`"
    ]
    assert "old.mlxfn" in said.out and (tmp_path / "old.mlxfn").stat().st_size > 0
    with pytest.raises(SystemExit, match="^2$"):  # neither spelling: one line naming --checkpoint
        export_main(["--to", "mlx", str(tmp_path / "only.mlxfn")])
    assert "the following arguments are required: --checkpoint" in capsys.readouterr().err


def test_an_override_is_told_from_an_input(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("model.x=1.png").write_bytes(b"")  # a file that exists is an input, whatever its name
    overrides, rest = cli.split_overrides(["seed=3", "model.x=1.png", "a.png", "data.path=d", "photo=1.jpg"], True)
    assert overrides == ["seed=3", "data.path=d"] and rest == ["model.x=1.png", "a.png", "photo=1.jpg"]
    with pytest.raises(UsageError, match=r"^override: shedule: unknown key; did you mean schedule\?$"):
        cli.split_overrides(["shedule.batch_size=4", "a.png"], others=True)
    with pytest.raises(UsageError, match=r"^override 'a.png': expected section.key=value$"):
        cli.split_overrides(["a.png"])
