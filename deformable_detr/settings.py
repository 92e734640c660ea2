"""Every environment variable `deformable_detr` reads, read here only (its settings, as kernels/settings.py's
`Setting`s: name, default, values, what it does, parser), and `OUTSIDE`, other libraries' variables the package
reads. `markdown()` makes docs/settings.md's tables from these and from kernels/settings.py's (`kernels` has its
own prefix, KERNELS_): `python -m deformable_detr.settings docs/settings.md` writes them there;
tests/test_settings.py holds the tables, the docs and the code to each other."""

import sys
from pathlib import Path

from kernels import settings as kernels_settings
from kernels.settings import Outside, Setting, switch

PREFIX = "DEFORMABLE_DETR_"
PACKAGE = "deformable_detr"


def folder(text: str) -> Path:
    return Path(text)


TRACEBACK = Setting(
    "DEFORMABLE_DETR_TRACEBACK",
    False,
    "0",
    "0, 1",
    "1: a command stopped by an error prints the traceback before its one line (deformable_detr/errors.py)",
    switch,
    package=PACKAGE,
)
CACHE = Setting(
    "DEFORMABLE_DETR_CACHE",
    None,
    "$XDG_CACHE_HOME/deformable-detr-mlx, else ~/.cache/deformable-detr-mlx",
    "a folder",
    "where `hf://` weights converted to this port's layout are kept, once a snapshot (deformable_detr/weights/hub.py)",
    folder,
    package=PACKAGE,
)
SETTINGS = (TRACEBACK, CACHE)

MALLOC_WHY = (
    "where set, malloc is left as the user set it (else runtime.py keeps freed memory, in at most ARENAS heaps)"
)
OUTSIDE = (
    Outside("MALLOC_MMAP_THRESHOLD_", "glibc", "reads", ("deformable_detr/runtime.py",), MALLOC_WHY, PACKAGE),
    Outside("MALLOC_TRIM_THRESHOLD_", "glibc", "reads", ("deformable_detr/runtime.py",), MALLOC_WHY, PACKAGE),
    Outside("MALLOC_ARENA_MAX", "glibc", "reads", ("deformable_detr/runtime.py",), MALLOC_WHY, PACKAGE),
    Outside(
        "HF_HUB_OFFLINE",
        "huggingface_hub",
        "reads",
        ("deformable_detr/weights/hub.py",),
        "1: `hf://` weights come from the cache only, nothing is fetched",
        PACKAGE,
    ),
    Outside(
        "HF_HUB_CACHE",
        "huggingface_hub",
        "reads",
        ("deformable_detr/weights/hub.py",),
        "where the Hub's repositories are cached",
        PACKAGE,
    ),
    Outside(
        "HF_HOME",
        "huggingface_hub",
        "reads",
        ("deformable_detr/weights/hub.py",),
        "the cache is $HF_HOME/hub where HF_HUB_CACHE is unset",
        PACKAGE,
    ),
    Outside(
        "XDG_CACHE_HOME",
        "the XDG base directories",
        "reads",
        ("deformable_detr/weights/hub.py",),
        "DEFORMABLE_DETR_CACHE's default lies in it",
        PACKAGE,
    ),
    Outside(
        "MLFLOW_TRACKING_URI",
        "MLflow",
        "reads",
        ("deformable_detr/training/mlflow_run.py",),
        "`train.mlflow: true` logs there, not to the run directory's own store (docs/tracking_experiments.md)",
        PACKAGE,
    ),
    Outside(
        "MLFLOW_EXPERIMENT_NAME",
        "MLflow",
        "reads",
        ("deformable_detr/training/mlflow_run.py",),
        "the experiment, else deformable-detr",
        PACKAGE,
    ),
    Outside(
        "WANDB_PROJECT",
        "W&B",
        "reads",
        ("deformable_detr/training/wandb_run.py",),
        "the project, else deformable-detr",
        PACKAGE,
    ),
)

ALL_SETTINGS = (*kernels_settings.SETTINGS, *SETTINGS)
ALL_OUTSIDE = (*kernels_settings.OUTSIDE, *OUTSIDE)


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """docs/settings.md's two tables: every setting of the two packages, then the others' variables they read or
    set."""
    lines = [
        "| variable | old name | default | values | what it does | package |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for s in ALL_SETTINGS:
        old = f"`{s.old}`" if s.old else ""
        lines.append(f"| `{s.name}` | {old} | {cell(s.shown)} | {cell(s.values)} | {cell(s.does)} | `{s.package}` |")
    lines += ["", "| variable | whose | what the package does | where | why |", "| --- | --- | --- | --- | --- |"]
    for o in ALL_OUTSIDE:
        where = ", ".join(f"`{path}`" for path in o.where)
        lines.append(f"| `{o.name}` | {cell(o.whose)} | {cell(o.how)} | {where} | {cell(o.why)} |")
    return "\n".join(lines) + "\n"


START, END = "<!-- the tables: made by deformable_detr/settings.py's markdown() -->\n", "<!-- end of the tables -->"


def with_tables(page: str) -> str:
    """`page` (docs/settings.md's text) with `markdown()` between its START and END lines."""
    head, start, rest = page.partition(START)
    _, end, tail = rest.partition(END)
    if not (start and end):
        raise ValueError(f"the page has no {START.strip()} ... {END} lines")
    return head + start + markdown() + end + tail


if __name__ == "__main__":  # python -m deformable_detr.settings [docs/settings.md]: print the tables, or write them
    if len(sys.argv) > 1:
        page = Path(sys.argv[1])
        page.write_text(with_tables(page.read_text()))
    else:
        print(markdown(), end="")
