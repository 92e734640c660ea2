"""`errors.install_hint`: the pip command for an extra, right where the package runs from (a source
checkout: `pip install -e` of it; an installed wheel: the distribution's extra from the index)."""

import sys
from pathlib import Path

from deformable_detr import errors
from deformable_detr.data import images
from deformable_detr.errors import CommandError, install_hint
from deformable_detr.training.tensorboard import require_tensorboard

import pytest
from PIL import Image, UnidentifiedImageError

ROOT = Path(__file__).resolve().parent.parent


def installed_package(tmp_path) -> Path:
    """A package folder as a wheel installs it: site-packages holds no pyproject.toml."""
    package = tmp_path / "site-packages" / "deformable_detr"
    package.mkdir(parents=True)
    return package


def test_in_this_checkout_the_hint_is_its_editable_install(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert install_hint("onnx") == 'pip install -e ".[onnx]"'


def test_from_another_folder_the_editable_install_names_the_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where "." would be "does not appear to be a Python project"
    assert install_hint("onnx") == f'pip install -e "{ROOT}[onnx]"'


def test_outside_a_checkout_the_hint_is_the_distributions_extra(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert install_hint("onnx", installed_package(tmp_path)) == 'pip install "deformable-detr-mlx[onnx]"'


def test_a_checkout_is_known_by_its_project_name_not_any_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    package = tmp_path / "repo" / "deformable_detr"
    package.mkdir(parents=True)
    pyproject = package.parent / "pyproject.toml"
    pyproject.write_text('[project]\nname = "another-project"\n\n[tool.x]\nname = "deformable-detr-mlx"\n')
    assert install_hint("heif", package) == 'pip install "deformable-detr-mlx[heif]"'
    pyproject.write_text('[build-system]\nrequires = ["setuptools"]\n\n[project]\nname = "deformable-detr-mlx"\n')
    assert install_hint("heif", package) == f'pip install -e "{package.parent}[heif]"'


def test_tensorboard_missing_outside_a_checkout_names_the_distributions_extra(tmp_path, monkeypatch):
    monkeypatch.setattr(errors, "PACKAGE_DIR", installed_package(tmp_path))
    monkeypatch.setitem(sys.modules, "tensorboard.summary.writer.event_file_writer", None)  # as if not installed
    with pytest.raises(CommandError) as stopped:
        require_tensorboard()
    assert str(stopped.value) == (
        'train.tensorboard: true needs tensorboard, in the "tensorboard" extra: '
        'pip install "deformable-detr-mlx[tensorboard]"'
    )


def test_heic_without_the_extra_outside_a_checkout_names_the_distributions_extra(tmp_path, monkeypatch):
    monkeypatch.setattr(errors, "PACKAGE_DIR", installed_package(tmp_path))
    monkeypatch.setattr(images, "HEIF_READABLE", False)
    (tmp_path / "photo.heic").write_bytes(b"\0\0\0\x18ftypheic\0\0\0\0mif1heic" + bytes(64))
    monkeypatch.setattr(Image, "open", _unidentified)  # as where no plugin is registered
    with pytest.raises(images.UnreadableImageError) as unread:
        images.read_image(tmp_path / "photo.heic")
    assert str(unread.value).endswith('reading it takes the heif extra (pip install "deformable-detr-mlx[heif]")')


def _unidentified(path, *args, **kwargs):
    raise UnidentifiedImageError(f"cannot identify image file {str(path)!r}")


def _guards():
    """(what, the module hidden, a call that asks for it) for every place that imports an optional package."""
    from deformable_detr.commands import predict_video, serve
    from deformable_detr.data import shapes_video
    from deformable_detr.deploy.onnx import export
    from deformable_detr.inference import confusion, evaluation_backends, slicing, tracking
    from deformable_detr.training import mlflow_run, tensorboard, wandb_run
    from deformable_detr.weights import authors, conversion

    def confusion_matrix():  # it does without: says the line, answers None
        confusion.supervision.cache_clear()
        try:
            answer = confusion.supervision()
        finally:
            confusion.supervision.cache_clear()  # not the None of the hidden package, for the tests after
        if answer is None:
            raise errors.MissingExtra(sys.stderr.getvalue().strip().removeprefix("confusion matrix left out: "))

    return [
        ("tracking", "trackers", tracking._trackers),
        ("slicing", "supervision", slicing.supervision),
        ("the confusion matrix", "supervision", confusion_matrix),
        ("reading a video", "av", predict_video._av),
        ("writing a video", "av", lambda: shapes_video.write_video("x.mp4", None)),
        ("train.mlflow", "mlflow.tracking", lambda: mlflow_run.require_mlflow(True)),
        ("train.mlflow", "sqlalchemy", lambda: mlflow_run.require_mlflow(True)),
        ("train.wandb", "wandb", wandb_run.require_wandb),
        ("train.tensorboard: true", "tensorboard.summary.writer.event_file_writer", tensorboard.require_tensorboard),
        ("exporting to ONNX", "onnx", lambda: export.require("onnx")),
        ("serve", "uvicorn", serve.server_modules),
        ("serve", "starlette", serve.server_modules),
        ("serve", "multipart", serve.server_modules),
        (
            "evaluation.backend faster_coco_eval",
            "faster_coco_eval",
            lambda: evaluation_backends.resolve_backend("faster_coco_eval"),
        ),
        ("reading .pth / .bin files", "torch", lambda: authors._read_torch(Path("model.pth"))),
        ("exporting to PyTorch", "torch", lambda: conversion.export_torch({}, {}, Path("model.pth"))),
    ]


def _extras() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


@pytest.mark.parametrize("what, module, call", _guards(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_optional_package_is_asked_for_one_way(what, module, call, monkeypatch, capsys):
    """Each guard, its package hidden: one line, `{what} needs {package}, in the "{extra}" extra: {pip line}`, naming
    an extra of pyproject.toml that lists the package."""
    import io
    import re

    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError (the very module: a test before may
    # have imported it, and a submodule in sys.modules is found without its package)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    monkeypatch.chdir(ROOT)
    with pytest.raises(errors.MissingExtra) as raised:
        call()
    message = str(raised.value)
    found = re.fullmatch(r'(.+) needs (\S+), in the "([a-z-]+)" extra: pip install -e "\.\[([a-z-]+)\]"', message)
    assert found, message
    assert found[1].endswith(what) and found[2] == module.split(".")[0] and found[3] == found[4]
    requirements = [re.split(r"[<>=;\[ ]", r)[0].lower().replace("-", "_") for r in _extras()[found[3]]]
    package = module.split(".")[0]
    distribution = {"multipart": "python_multipart", "mlflow": "mlflow_skinny"}.get(package, package)
    assert distribution in requirements, f"the {found[3]} extra does not list {module}: {requirements}"
