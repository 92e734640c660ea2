"""bench/README.md's tables are made from bench/results/cpu/ (bench/tables.py): the page says what the
results files say, and each CPU kind's files name their CPU and date in the lines the page keeps."""

import re
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import tables  # noqa: E402


def test_the_readmes_tables_are_the_results():
    readme = tables.README.read_text()
    assert tables.with_tables(readme) == readme, "run python bench/tables.py"


def test_every_kinds_results_say_when_and_on_which_cpu():
    kinds = [path for path in tables.KINDS.iterdir() if path.is_dir()]
    assert kinds
    for kind in kinds:
        files = [kind / name for name in tables.FILES if (kind / name).is_file()]
        assert files, kind
        for path in files:
            text = path.read_text()
            assert "CPU" in text and re.search(r"\d{4}-\d{2}-\d{2}", text), path
