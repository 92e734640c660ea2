"""The benchmark scripts refuse counts they cannot measure with, in one line, before measuring anything:
`model.py --alternate 0` once ran the whole table instead, `shape_memory.py --train-shapes 0` measured for a
minute and then failed on the tenth shape it never had."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.parametrize(
    "script, arguments, named",
    [
        ("model.py", ["--alternate", "0"], "--alternate: '0': expected a number of pairs, at least 1"),
        ("shape_memory.py", ["--train-shapes", "0"], "--train-shapes: '0': expected a number of shapes, at least 10"),
        ("shape_memory.py", ["--inference-shapes", "9"], "--inference-shapes: '9': expected a number of shapes"),
    ],
)
def test_a_count_it_cannot_use_is_refused_in_one_line(script, arguments, named):
    done = subprocess.run(
        [sys.executable, str(BENCH / script), *arguments], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: argument ") and named in done.stderr
