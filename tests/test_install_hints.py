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
        'train.tensorboard: true needs the tensorboard package: pip install "deformable-detr-mlx[tensorboard]"'
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
