"""Every environment variable `kernels` reads, read here only: `SETTINGS`, one `Setting` each (name, default,
values, what it does, its parser), and `OUTSIDE`, other libraries' variables this package reads or sets.
docs/settings.md's tables are made from these (deformable_detr/settings.py's `markdown`), and
tests/test_settings.py holds the tables, the docs and the code to each other.

A setting is read where it is used (`SELF_CHECK.value()`), or passed into the C++ extensions when they load
(KERNELS_ATTENTION_ISA, KERNELS_ONEDNN_SLOWER_PASSES: their C++ reads no environment). A bad value is a
ValueError naming the variable, the value and what is expected. A variable's old name (DEFORMABLE_DETR_*,
before `kernels` had a prefix of its own) is still read, with a note on stderr once a process.
This module imports no MLX (the BLAS's choice is read before MLX loads)."""

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

PREFIX = "KERNELS_"


@dataclass(frozen=True)
class Setting:
    """An environment variable of a package: `name`, `default` (its value where unset or empty, `shown` in the
    docs), `values` (what it takes, in words), what it `does`, `parse` (the text -> the value, or a ValueError
    saying what is expected), and `old`, a former name still read."""

    name: str
    default: object
    shown: str
    values: str
    does: str
    parse: Callable[[str], object]
    old: str | None = None
    package: str = "kernels"

    def value(self, environ: Mapping[str, str] | None = None):
        """Its value in `environ` (default: this process's environment)."""
        read, text = self.text(environ)
        if not text:
            return self.default
        try:
            return self.parse(text)
        except ValueError as expected:
            raise ValueError(f"{read}={text!r}: expected {expected}") from None

    def text(self, environ: Mapping[str, str] | None = None) -> tuple[str, str]:
        """(the name read, its text stripped; "" where unset): the old name's where only it is set, with a note."""
        environ = os.environ if environ is None else environ
        text, former = environ.get(self.name, "").strip(), environ.get(self.old, "").strip() if self.old else ""
        if former:
            _note_once(self, both=bool(text))
        return (self.name, text) if text or not former else (self.old, former)


@dataclass(frozen=True)
class Outside:
    """Another library's variable that `where` (a file of the package) reads or sets: `how` ("reads", "sets"),
    `whose` (the library that acts on it), and why."""

    name: str
    whose: str
    how: str
    where: tuple[str, ...]
    why: str
    package: str = "kernels"


_noted: set = set()


def _note_once(setting: Setting, both: bool):
    if setting.old in _noted:
        return
    _noted.add(setting.old)
    said = f"both are set: {setting.name} is read" if both else "read this time"
    print(f"{setting.package}: {setting.old} is now {setting.name}; {said}", file=sys.stderr)


def one_of(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in allowed:
            raise ValueError(f"one of {', '.join(allowed)}")
        return text

    return parse


def switch(text: str) -> bool:
    """1 or 0."""
    if text not in ("0", "1"):
        raise ValueError("1 or 0")
    return text == "1"


def whole_number(text: str) -> int:
    if not text.isdigit():
        raise ValueError("a whole number >= 0")
    return int(text)


def isa_level(text: str) -> int:
    if text not in ("0", "1", "2"):
        raise ValueError("0, 1 or 2")
    return int(text)


BACKENDS = ("mlx", "metal", "cuda", "cpu")  # backends.NAMES (that module imports MLX)
BLAS_CHOICES = ("auto", "openblas", "mkl", "bundled")

BACKEND = Setting(
    "KERNELS_BACKEND",
    None,
    "unset: the automatic choice",
    "mlx, metal, cuda, cpu",
    "the back-end of the calls that name none (`backend=`): for callers that cannot pass it, such as a model; "
    "a back-end named is used as told, unchecked",
    one_of(*BACKENDS),
)
SELF_CHECK = Setting(
    "KERNELS_SELF_CHECK",
    True,
    "1",
    "1, 0",
    "0: a fused GPU kernel runs without first checking itself against the MLX-ops path (kernels/selfcheck.py)",
    switch,
)
ATTENTION_ISA = Setting(
    "KERNELS_ATTENTION_ISA",
    2,
    "2",
    "0 (baseline), 1 (AVX2), 2 (AVX-512)",
    "caps the build of the C++ attention kernel this CPU runs (the widest it has, at most this), so that one "
    "machine can test and time the narrower builds; given to kernels._native when it loads",
    isa_level,
)
ONEDNN = Setting(
    "KERNELS_ONEDNN",
    True,
    "1",
    "1, 0",
    "0: convolutions and matrix products on MLX (im2col and the BLAS), not oneDNN (kernels/onednn.py)",
    switch,
    old="DEFORMABLE_DETR_ONEDNN",
)
ONEDNN_PLANS = Setting(
    "KERNELS_ONEDNN_PLANS",
    32,
    "32",
    "a whole number >= 0",
    "how many oneDNN plans (a shape's primitives) of each kind, convolutions and products, are kept; oneDNN's own "
    "primitive cache gets as many primitives (kernels/native/onednn.cpp's top says what 32 keeps)",
    whole_number,
    old="DEFORMABLE_DETR_ONEDNN_PLANS",
)
ONEDNN_WEIGHTS_MIB = Setting(
    "KERNELS_ONEDNN_WEIGHTS_MIB",
    512,
    "512",
    "a whole number >= 0",
    "MiB of a model's weight copies in oneDNN's layouts kept at most (`onednn.kept_weights()`, a Detector's)",
    whole_number,
    old="DEFORMABLE_DETR_ONEDNN_WEIGHTS_MIB",
)
ONEDNN_SLOWER_PASSES = Setting(
    "KERNELS_ONEDNN_SLOWER_PASSES",
    False,
    "0",
    "0, 1",
    "1: every convolution pass and product on oneDNN's own kernel, even where the patches or a 1 x 1 convolution "
    "are faster (for bench/conv_backward.py to time both); given to kernels._onednn when it loads",
    switch,
    old="DEFORMABLE_DETR_ONEDNN_SLOWER_PASSES",
)
BLAS = Setting(
    "KERNELS_BLAS",
    "auto",
    "auto",
    "auto, openblas, mkl, bundled",
    "the BLAS under MLX's matrix products, loaded when `kernels` is imported: auto is MKL on Intel CPUs where "
    "installed, else OpenBLAS, else MLX's bundled one (kernels/blas.py); a bad value is a warning, then auto",
    one_of(*BLAS_CHOICES),
    old="DEFORMABLE_DETR_BLAS",
)
SETTINGS = (BACKEND, SELF_CHECK, ATTENTION_ISA, ONEDNN, ONEDNN_PLANS, ONEDNN_WEIGHTS_MIB, ONEDNN_SLOWER_PASSES, BLAS)

OUTSIDE = (
    Outside(
        "OMP_WAIT_POLICY",
        "GNU OpenMP (oneDNN's threads)",
        "sets PASSIVE, unless set",
        ("kernels/onednn.py",),
        "idle threads sleep instead of spinning on the cores MLX and the attention kernel run on next",
    ),
    Outside(
        "OPENBLAS_THREAD_TIMEOUT",
        "OpenBLAS",
        "sets 4, unless set",
        ("kernels/blas.py",),
        "idle threads stop spinning after 2**4 cycles (was 2**28): an R50 inference 0.3 s faster",
    ),
    Outside(
        "ONEDNN_MAX_CPU_ISA",
        "oneDNN",
        "reads",
        ("kernels/onednn.py",),
        "to say why bfloat16 is not fast where the cap keeps oneDNN from the CPU's bfloat16 instructions",
    ),
)
