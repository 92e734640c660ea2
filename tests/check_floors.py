"""The lower bounds pyproject.toml puts on the extras whose code relies on a version's feature, each
tested at its floor: that version installed alone into a folder put first on PYTHONPATH (the rest of
the venv as it is), then the tests of the code that relies on it. Outside the suite: it downloads.

    python tests/check_floors.py [--only supervision ...]

- supervision >= 0.30.0: InferenceSlicer's batch_size (inference/slicing.py; 0.29 has none), read by
  the slice and confusion-matrix extras; and what trackers needs of it.
- uvicorn >= 0.30.0: serving/connections.py subclasses its h11 protocol (connection_made,
  data_received, connection_lost, .conn, .loop, .transport).
- trackers >= 2.6.0: ByteTrackTracker / SORTTracker / OCSORTTracker's frame_rate and thresholds and
  MotionAwareTraceAnnotator (inference/tracking.py).

Each floor's line says the version that ran (read back from the package itself) and pytest's summary."""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {  # distribution: (its floor, its import name, the tests of the code that relies on it)
    "supervision": (
        "0.30.0",
        "supervision",
        ["tests/test_slicing.py", "tests/test_confusion_matrix.py", "tests/test_tracking.py"],
    ),
    "uvicorn": ("0.30.0", "uvicorn", ["tests/test_serve.py", "tests/test_serve_limits.py"]),
    "trackers": ("2.6.0", "trackers", ["tests/test_tracking.py"]),
}


def floor_in_pyproject(name: str) -> str:
    """The `name>=X` floor pyproject.toml's extras give (each extra listing it: one floor)."""
    found = set(re.findall(rf'"{name}>=([0-9.]+)', (ROOT / "pyproject.toml").read_text()))
    if len(found) != 1:
        raise SystemExit(f"pyproject.toml: {name}'s floor is {sorted(found) or 'missing'}; expected one")
    return found.pop()


def check(name: str) -> str:
    floor, module, tests = FLOORS[name]
    if floor_in_pyproject(name) != floor:
        raise SystemExit(f"{name}: pyproject.toml says >={floor_in_pyproject(name)}, this script {floor}")
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", folder, f"{name}=={floor}"],
            check=True,
        )
        env = os.environ | {"PYTHONPATH": os.pathsep.join([folder, str(ROOT), os.environ.get("PYTHONPATH", "")])}
        version = subprocess.run(
            [sys.executable, "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        ran = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        summary = ran.stdout.strip().splitlines()[-1] if ran.stdout.strip() else ran.stderr.strip()[-200:]
        failed = "" if ran.returncode == 0 else " FAILED"
        return f"{name} {version} (floor {floor}): {' '.join(tests)}: {summary}{failed}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(FLOORS), default=sorted(FLOORS))
    args = parser.parse_args()
    lines = [check(name) for name in args.only]
    print("\n".join(lines))
    sys.exit(any(line.endswith("FAILED") for line in lines))


if __name__ == "__main__":
    main()
