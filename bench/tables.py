"""bench/README.md's current tables: one section per CPU kind measured, made from the latest runs kept in
bench/results/cpu/KIND/ (each script's own output, its first line saying when and on which CPU):

    python bench/tables.py           # rewrites the README's section between its two markers
    python bench/tables.py --check   # exits 1 where the README is not what the results say (tests run it)

A kind's folder holds what these scripts wrote there (each optional): model.py --output-dir (inference and
training steps against PyTorch), deploy.py --output-dir (runtimes on our ONNX file), attention.py --output
(the attention core), shape_memory.py --output (memory over many image shapes), kept_weights.py --output
(inference with kept weight copies), model.py --alternate (the training step's ratio from alternating
pairs: its summary lines, not its table of pairs). bench/README.md#reproduce
says how to run them for a new kind.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS  # noqa: E402

README = Path(__file__).resolve().parent / "README.md"
KINDS = RESULTS / "cpu"
START, END = "<!-- tables: made by bench/tables.py from bench/results/cpu/ -->", "<!-- end of the tables -->"
# file -> (what it is, the lines kept besides its markdown table: their prefixes)
FILES = {
    "model_cpu.txt": ("R50 inference and training step against PyTorch (`model.py`)", ("run:", "`--precision auto`")),
    "deploy_cpu.txt": ("R50 inference where a model is deployed (`deploy.py`)", ("CPU:", "OpenVINO: not")),
    "attention_cpu.txt": ("the attention core against the authors' PyTorch core (`attention.py`)", ("machine:",)),
    "shape_memory_cpu.txt": ("memory over many image shapes, oneDNN against none (`shape_memory.py`)", ("date:",)),
    "kept_weights_cpu.txt": ("R50 inference, weights' copies kept or made (`kept_weights.py`)", ("date:",)),
    "train_alternating.txt": (
        "the training step, PyTorch's processes and ours alternating (`model.py --alternate`)",
        ("run:", "medians:"),
    ),
}
WITHOUT_TABLE = {"train_alternating.txt"}  # its table is a row per pair: the file has them


def section(kind: Path) -> list[str]:
    """A kind's lines: its title (the folder's name), then each result's name, kept lines and table."""
    lines = [f"### {kind.name}", ""]
    for name, (what, kept) in FILES.items():
        path = kind / name
        if not path.is_file():
            continue
        text = path.read_text().splitlines()
        lines += [f"{what}, [`{path.relative_to(README.parent)}`]({path.relative_to(README.parent)}):"]
        lines += [f"> {line}" for line in text if line.startswith(kept)] + [""]
        if name in WITHOUT_TABLE:
            continue
        for before, line in zip(["", *text], text, strict=False):  # each table, a blank line after it
            if line.startswith("|"):
                lines.append(line)
            elif before.startswith("|"):
                lines.append("")
        lines += [] if lines[-1] == "" else [""]
    return lines


def tables() -> str:
    kinds = sorted(path for path in KINDS.iterdir() if path.is_dir()) if KINDS.is_dir() else []
    return "\n".join([START, "", *(line for kind in kinds for line in section(kind)), END])


def with_tables(readme: str) -> str:
    if START not in readme or END not in readme:
        raise SystemExit(f"error: {README} has no {START} ... {END} section")
    before, rest = readme.split(START, 1)
    return before + tables() + rest.split(END, 1)[1]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    readme = README.read_text()
    wanted = with_tables(readme)
    if argv == ["--check"]:
        if wanted != readme:
            raise SystemExit("error: bench/README.md's tables are not bench/results/cpu's: run python bench/tables.py")
        return
    README.write_text(wanted)
    print(f"wrote the tables of {README}")


if __name__ == "__main__":
    main()
