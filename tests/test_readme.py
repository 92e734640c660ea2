import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_examples_run():
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if "import kernels" in b]
    assert blocks, "README.md has no kernels example"
    for block in blocks:
        namespace = {}
        exec(compile(block, str(README), "exec"), namespace)
        assert namespace["grad_locations"].shape == namespace["locations"].shape
        assert namespace["out"].shape == (2, 50, 8 * 32)
