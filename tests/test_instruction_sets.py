"""Right on every x86 CPU: what runs depends on the CPU's instructions (oneDNN's kernels, whether
bfloat16 products are fast), so the engine's and the precision's tests run again here under each lower
instruction set oneDNN can be capped to (ONEDNN_MAX_CPU_ISA: AVX2, AVX512_CORE, AVX512_CORE_BF16), and a
machine with AMX or AVX512-BF16 also tests what an AVX2 machine does. The training precision's refusal
is tested here too, against this machine's own answer."""

import os
import subprocess
import sys
from pathlib import Path

import kernels
from deformable_detr import load_config
from deformable_detr.commands.train import check_settings
from deformable_detr.commands.train import main as train_main
from deformable_detr.errors import UsageError
from kernels import onednn

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The tests that depend on the instruction set: oneDNN's engine and caches, the precision resolved and
# said (the precision line, eval_results.json), this file's refusal.
CAPPED_TESTS = [
    "tests/test_onednn.py",
    "tests/test_detector.py::test_bfloat16_products_keep_the_float32_detections",
    "tests/test_instruction_sets.py::test_train_refuses_bfloat16_where_its_products_are_slow",
]


def cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return set(next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), []))
    except OSError:
        return set()


def lower_instruction_sets() -> list:
    """The ONEDNN_MAX_CPU_ISA values below this CPU's best (none where it is AVX2 only, or not x86)."""
    flags = cpu_flags()
    caps = ["AVX2"] if {"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags else []
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        caps.append("AVX512_CORE")
    if "amx_bf16" in flags:
        caps.append("AVX512_CORE_BF16")
    return caps


def test_train_refuses_bfloat16_where_its_products_are_slow(tmp_path, capsys):
    """train.precision=bfloat16 where bfloat16 products are not fast: one line naming why, before
    anything is built; train.precision_even_if_slow=true lets it run. Where they are fast: no refusal."""
    fast, why = kernels.bfloat16_products()
    asked = load_config(ROOT / "configs" / "shapes.yaml", ["train.precision=bfloat16"])
    insisting = load_config(
        ROOT / "configs" / "shapes.yaml", ["train.precision=bfloat16", "train.precision_even_if_slow=true"]
    )
    check_settings(insisting, 1)
    if fast:
        check_settings(asked, 1)
        return
    with pytest.raises(UsageError) as refused:
        check_settings(asked, 1)
    with pytest.raises(SystemExit) as stopped:
        train_main(
            [
                "--config",
                str(ROOT / "configs" / "shapes.yaml"),
                "--output-dir",
                str(tmp_path / "run"),
                "train.precision=bfloat16",
            ]
        )
    assert str(refused.value) == (
        f"train.precision=bfloat16: {why}, so bfloat16 would run slower than float32; use float32, or insist "
        "with train.precision_even_if_slow=true"
    )
    assert stopped.value.code == 2 and capsys.readouterr().err == f"error: {refused.value}\n"
    assert not (tmp_path / "run").exists()  # nothing built or written


@pytest.mark.skipif(onednn.module() is None, reason=f"oneDNN is not used here: {onednn.missing()}")
@pytest.mark.skipif(
    bool(os.environ.get("ONEDNN_MAX_CPU_ISA")), reason="already capped: this run is one of the capped runs"
)
@pytest.mark.parametrize("cap", ["AVX2", "AVX512_CORE", "AVX512_CORE_BF16"])
def test_the_engine_and_precision_tests_pass_as_an_older_cpu(cap):
    if cap not in lower_instruction_sets():
        pytest.skip(f"this CPU has no instructions above {cap}'s to hide (flags: no AVX-512, BF16 or AMX beyond it)")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CAPPED_TESTS],
        cwd=ROOT,
        env={**os.environ, "ONEDNN_MAX_CPU_ISA": cap},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1]
