"""Every environment variable in one table (kernels/settings.py, deformable_detr/settings.py, docs/settings.md):
each read in its package's settings module only, none in C++, every name said anywhere in the table, the page
the code's table, bad values refused in one line, old names read with a note."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import kernels
from deformable_detr import settings
from kernels import backends
from kernels import settings as kernels_settings

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "deformable_detr")
OWN = re.compile(r"\b(?:KERNELS|DEFORMABLE_DETR)_[A-Z0-9_]*[A-Z0-9]\b")  # a name under either prefix
VARIABLE_SHAPED = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+_?")  # HF_HOME, MALLOC_TRIM_THRESHOLD_
SETTINGS_FILES = {"kernels/settings.py", "deformable_detr/settings.py"}
NAMES = {s.name for s in settings.ALL_SETTINGS}
OLD_NAMES = {s.old for s in settings.ALL_SETTINGS if s.old}
OUTSIDE = {o.name: o for o in settings.ALL_OUTSIDE}


def package_files(*suffixes) -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*") if p.suffix in suffixes)


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def is_environ(node) -> bool:
    """`os.environ`, a parameter named `environ`, or either of `a if c else b`, `a or b`."""
    if isinstance(node, ast.IfExp):
        return is_environ(node.body) or is_environ(node.orelse)
    if isinstance(node, ast.BoolOp):
        return any(is_environ(value) for value in node.values)
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def environment_reads(tree) -> list[ast.AST]:
    """The expressions naming the variable of each read or write of the environment in `tree`."""
    named = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner, method = node.func.value, node.func.attr
            if is_environ(owner) and method in ("get", "setdefault", "pop") and node.args:
                named.append(node.args[0])
            elif method in ("getenv", "putenv") and node.args:
                named.append(node.args[0])
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            named.append(node.slice)
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            named.append(node.left)
    return named


def strings(tree) -> list[str]:
    """Every string constant in `tree` but docstrings (f-strings' literal parts included)."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def test_each_variable_is_read_in_one_place_and_is_in_the_table():
    """An own variable (KERNELS_*, DEFORMABLE_DETR_*, old names too) is spelled and read in its package's
    settings module only; another library's variable is read or set only where its row says."""
    problems = []
    for path in package_files(".py"):
        where, tree = relative(path), ast.parse(path.read_text())
        constants = strings(tree)
        if where not in SETTINGS_FILES:
            problems += [f"{where}: {text!r} spells an own variable" for text in constants if OWN.search(text)]
        read = set()
        for named in environment_reads(tree):
            if isinstance(named, ast.Constant):
                read.add(named.value)
            elif where not in SETTINGS_FILES:  # (there: a Setting's own names) a name held elsewhere in the file:
                read |= {text for text in constants if VARIABLE_SHAPED.fullmatch(text)}  # any such string of it
        for name in sorted(read):
            if name in NAMES | OLD_NAMES:
                ok = where in SETTINGS_FILES
            else:
                ok = name in OUTSIDE and where in OUTSIDE[name].where
            if not ok:
                problems.append(f"{where} reads {name}: the tables (kernels/ and deformable_detr/settings.py) say not")
    assert not problems, "\n".join(problems)


def test_each_outside_row_names_a_file_that_uses_it():
    for row in settings.ALL_OUTSIDE:
        for where in row.where:
            assert row.name in strings(ast.parse((ROOT / where).read_text())), (row.name, where)


def test_the_cpp_reads_no_environment():
    sources = package_files(".cpp", ".h", ".cc", ".cu", ".metal")
    assert sources
    for path in sources:
        assert not re.search(r"\b(secure_)?getenv\b|\benviron\b", path.read_text()), relative(path)


def said_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "bench").glob("*.py"))]
    files += [ROOT / "kernels" / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "bench").glob("*.sh"))]
    files += package_files(".py", ".cpp", ".h", ".md")
    return sorted({path for path in files if relative(path) not in SETTINGS_FILES | {"docs/settings.md"}})


def test_every_name_said_is_a_setting_of_today():
    """In the docs, READMEs, bench scripts and the packages' code and comments: every KERNELS_* or DEFORMABLE_DETR_*
    is in the table, by its new name (bench/README's tables quote results files of runs before the rename)."""
    problems = []
    for path in said_files():
        text = path.read_text()
        if relative(path) == "bench/README.md":
            text = re.sub(r"<!-- tables: .*?<!-- end of the tables -->", "", text, flags=re.S)
        problems += [f"{relative(path)}: {name}" for name in sorted(set(OWN.findall(text)) - NAMES)]
    assert not problems, "\n".join(problems)


def test_the_page_is_the_codes_table():
    page = (ROOT / "docs" / "settings.md").read_text()
    assert settings.with_tables(page) == page, "run python -m deformable_detr.settings docs/settings.md"


def test_the_readmes_link_the_page():
    for readme in ("README.md", "kernels/README.md", "bench/README.md"):
        assert "settings.md" in (ROOT / readme).read_text(), readme


def test_each_name_under_its_packages_prefix_and_once():
    names = [s.name for s in settings.ALL_SETTINGS] + [s.old for s in settings.ALL_SETTINGS if s.old]
    assert len(names) == len(set(names))
    for s in kernels_settings.SETTINGS:
        assert s.package == "kernels" and s.name.startswith(kernels_settings.PREFIX), s.name
    for s in settings.SETTINGS:
        assert s.package == "deformable_detr" and s.name.startswith(settings.PREFIX), s.name
    assert kernels_settings.BACKENDS == backends.NAMES  # written twice: settings.py imports no MLX


@pytest.mark.parametrize("setting", settings.ALL_SETTINGS, ids=lambda s: s.name)
def test_unset_or_empty_is_the_default_the_page_says(setting):
    assert setting.value({}) == setting.default
    assert setting.value({setting.name: " "}) == setting.default
    if setting.default is not None:
        assert setting.value({setting.name: setting.shown}) == setting.default  # the page's default is the code's


@pytest.mark.parametrize(
    "setting, bad, expected",
    [
        (kernels_settings.BACKEND, "vulkan", "one of mlx, metal, cuda, cpu"),
        (kernels_settings.SELF_CHECK, "yes", "1 or 0"),
        (kernels_settings.ATTENTION_ISA, "3", "0, 1 or 2"),
        (kernels_settings.ONEDNN, "off", "1 or 0"),
        (kernels_settings.ONEDNN_PLANS, "many", "a whole number >= 0"),
        (kernels_settings.ONEDNN_WEIGHTS_MIB, "-1", "a whole number >= 0"),
        (kernels_settings.ONEDNN_SLOWER_PASSES, "true", "1 or 0"),
        (kernels_settings.BLAS, "atlas", "one of auto, openblas, mkl, bundled"),
        (settings.TRACEBACK, "2", "1 or 0"),
    ],
    ids=lambda x: x.name if hasattr(x, "name") else None,
)
def test_a_bad_value_is_refused_naming_the_variable_the_value_and_what_is_expected(setting, bad, expected):
    with pytest.raises(ValueError) as refused:
        setting.value({setting.name: bad})
    assert str(refused.value) == f"{setting.name}={bad!r}: expected {expected}"


@pytest.fixture
def fresh_notes(monkeypatch):
    monkeypatch.setattr(kernels_settings, "_noted", set())


def test_an_old_name_is_read_with_one_note(fresh_notes, capsys):
    plans = kernels_settings.ONEDNN_PLANS
    assert plans.value({"DEFORMABLE_DETR_ONEDNN_PLANS": "5"}) == 5
    assert plans.value({"DEFORMABLE_DETR_ONEDNN_PLANS": "6"}) == 6
    noted = capsys.readouterr().err
    assert noted == "kernels: DEFORMABLE_DETR_ONEDNN_PLANS is now KERNELS_ONEDNN_PLANS; read this time\n"  # once
    with pytest.raises(ValueError, match=r"^DEFORMABLE_DETR_ONEDNN_PLANS='many': expected a whole number >= 0$"):
        plans.value({"DEFORMABLE_DETR_ONEDNN_PLANS": "many"})  # the name the value came under


def test_where_both_names_are_set_the_new_one_wins_and_the_note_says_so(fresh_notes, capsys):
    both = {"DEFORMABLE_DETR_BLAS": "mkl", "KERNELS_BLAS": "bundled"}
    assert kernels_settings.BLAS.value(both) == "bundled"
    assert capsys.readouterr().err == (
        "kernels: DEFORMABLE_DETR_BLAS is now KERNELS_BLAS; both are set: KERNELS_BLAS is read\n"
    )


def run(code: str, **environment) -> subprocess.CompletedProcess:
    ours = NAMES | OLD_NAMES
    env = {k: v for k, v in os.environ.items() if k not in ours} | {"PYTHONPATH": str(ROOT), **environment}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)


@pytest.mark.skipif(kernels.onednn.module() is None, reason=f"oneDNN is not used here: {kernels.onednn.missing()}")
def test_an_old_name_still_reaches_the_extension():
    done = run("from kernels import onednn; print(onednn.caches()['capacity'])", DEFORMABLE_DETR_ONEDNN_PLANS="7")
    assert (done.returncode, done.stdout, done.stderr) == (
        0,
        "7\n",
        "kernels: DEFORMABLE_DETR_ONEDNN_PLANS is now KERNELS_ONEDNN_PLANS; read this time\n",
    )


def test_a_command_refuses_a_bad_setting_as_it_starts(tmp_path):
    """Before any work, one line and exit 2 (a usage error), here for a setting read only by the C++ kernels' load."""
    arguments = [str(tmp_path / "none.pth"), str(tmp_path / "out.safetensors")]  # else: exit 1, no such file
    done = run(f"from deformable_detr.convert import main; main({arguments!r})", KERNELS_ATTENTION_ISA="3")
    assert (done.returncode, done.stderr) == (2, "error: KERNELS_ATTENTION_ISA='3': expected 0, 1 or 2\n")
