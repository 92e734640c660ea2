"""The commands as the installed package runs them, from any folder: `deformable-detr COMMAND` (the
console script, `python -m deformable_detr COMMAND`) and `python -m deformable_detr.COMMAND`, configs by
name, a config's relative data paths taken from the current directory. (.ci/run builds the wheel and
runs the commands from an empty folder in a fresh venv: `.ci/wheel`.)"""

import subprocess
import sys
from pathlib import Path

from deformable_detr.__main__ import COMMANDS
from deformable_detr.config import CONFIGS_DIR, config_file, load_config, shipped_configs
from deformable_detr.errors import UsageError

import pytest
import tomllib
from test_train import ROOT


def run(*arguments, cwd):
    return subprocess.run([sys.executable, *arguments], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_a_shipped_config_by_name_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert config_file("shapes") == config_file("shapes.yaml") == CONFIGS_DIR / "shapes.yaml"
    assert load_config("r50") == load_config(CONFIGS_DIR / "r50.yaml")
    assert {"r50", "shapes", "custom"} <= set(shipped_configs())
    (tmp_path / "shapes").write_text("seed: 7\n")  # a file of that name here is taken first
    assert load_config("shapes").seed == 7
    with pytest.raises(
        UsageError, match=r"config file not found: nope \(a path, or a shipped config: custom, dino_r50_4scale_12ep"
    ):
        load_config("nope")
    with pytest.raises(UsageError, match="config file not found: elsewhere/r50.yaml"):
        load_config("elsewhere/r50.yaml")  # a path names that file, never a shipped one


def test_the_checkouts_configs_are_the_shipped_ones():
    assert (ROOT / "configs").resolve() == CONFIGS_DIR
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "configs/*.yaml" in package_data["deformable_detr"]


def test_every_command_is_a_module_and_a_subcommand(tmp_path):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"deformable-detr": "deformable_detr.__main__:main"}
    for command in COMMANDS:
        for arguments in (["deformable_detr", command], [f"deformable_detr.{command}"]):
            done = run("-m", *arguments, "--help", cwd=tmp_path)
            assert done.returncode == 0 and done.stdout.startswith("usage: "), (arguments, done.stderr)
    assert run("-m", "deformable_detr", "train", "--help", cwd=tmp_path).stdout.startswith(
        "usage: deformable-detr train"
    )
    done = run("-m", "deformable_detr", cwd=tmp_path)
    assert done.returncode == 2 and "usage: deformable-detr COMMAND" in done.stdout
    done = run("-m", "deformable_detr", "fly", cwd=tmp_path)
    assert done.returncode == 2 and "error: 'fly' is not a command" in done.stderr


def test_check_generates_the_shapes_set_in_the_current_folder(tmp_path):
    done = run("-m", "deformable_detr", "check", "--config", "shapes", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"generating it in {Path('data/shapes')}" in done.stdout and "no problems found" in done.stdout
    assert (tmp_path / "data" / "shapes" / "annotations" / "instances_val2017.json").is_file()
    assert "train: 400 images" in done.stdout


def test_the_console_script_exits_0_whatever_a_command_returns(monkeypatch):
    # pip's console script runs sys.exit(main()): a command's value (eval's stats) would be printed, exit 1
    import types

    from deformable_detr import __main__ as console

    command = types.SimpleNamespace(main=lambda argv: {"AP": 0.5, "argv": argv})
    monkeypatch.setattr(console.importlib, "import_module", lambda name: command)
    monkeypatch.setattr(sys, "argv", ["deformable-detr"])
    assert console.main(["eval", "--checkpoint", "x"]) is None
