"""What the tensors' checksums cost a training checkpoint of the R50 model: saving it with them
(`write_safetensors`: SHA-256 of every tensor, then the file) against the same atomic write without
them, and reading it with the check (`read_weights`) against without (`verify=False`), every tensor
evaluated in both; the hashing alone each way, and SHA-256 against BLAKE2b on one thread; the file's
size.

    python bench/checksum.py [--config configs/r50.yaml] [--repeats 5] [--output bench/results/checksum_cpu.txt]

The model has random weights (the size is what matters) and the optimizer state of its trainable
parameters, as `save_checkpoint` writes them (an EMA too where the config has one). Rounds alternate
the two sides; the file is in the page cache, as it is right after a save or on a second read (from
a cold disk, reading takes longer on both sides alike).
"""

import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import kernels  # noqa: F401  (first: the BLAS the commands use)
from deformable_detr.errors import ArgumentParser, entry_point

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, load_average, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def checkpoint_arrays(config: Path, folder: Path):
    """-> (arrays, metadata) of a training checkpoint of `config`'s model (random weights), with its
    AdamW state (and EMA where the config has one), as `save_checkpoint` writes it; less the checksums."""
    from deformable_detr import build_model, load_config
    from deformable_detr.training.ema import EMA
    from deformable_detr.training.optimizer import build_optimizer, freeze_for_training
    from deformable_detr.weights.checkpoint import save_checkpoint
    from deformable_detr.weights.files import CHECKSUMS_KEY

    import mlx.core as mx

    cfg = load_config(config)
    mx.random.seed(0)
    model = build_model(cfg)
    freeze_for_training(model, cfg)
    optimizer = build_optimizer(cfg)
    optimizer.init(model.trainable_parameters())
    ema = EMA(model, cfg.train.ema_decay, cfg.train.ema_warmup) if cfg.train.ema_decay > 0 else None
    path = folder / "checkpoint.safetensors"
    save_checkpoint(path, model, optimizer, cfg, {"epoch": 0, "step": 0, "global_step": 0}, {}, ema)
    arrays, metadata = mx.load(str(path), return_metadata=True)
    mx.eval(list(arrays.values()))
    del metadata[CHECKSUMS_KEY]
    return arrays, metadata


def save_without_checksums(path, arrays, metadata):
    """`write_safetensors` as it was before checksums: the same atomic write, no hashing."""
    from deformable_detr.weights.files import atomic_write

    import mlx.core as mx

    with atomic_write(path) as tmp, open(tmp, "wb") as file:
        mx.save_safetensors(file, arrays, metadata=metadata)


def read_all(path, verify: bool):
    from deformable_detr.weights.files import open_safetensors

    import mlx.core as mx

    arrays, _ = open_safetensors(path, verify)
    mx.eval(list(arrays.values()))


def alternate(sides: dict, repeats: int) -> dict:
    """{side: [seconds of each round]}, the sides taking turns, after one warm-up call each."""
    times = {name: [] for name in sides}
    for run in sides.values():
        run()
    for _ in range(repeats):
        for name, run in sides.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times


def lines_of(title: str, times: dict) -> list[str]:
    (plain, plain_times), (checked, checked_times) = times.items()
    a, b = statistics.median(plain_times), statistics.median(checked_times)
    lines = [title]
    for name, median, rounds in ((plain, a, plain_times), (checked, b, checked_times)):
        lines.append(f"- {name}: {median:.3f} s (each round: {', '.join(f'{t:.3f}' for t in rounds)})")
    return lines + [f"- ratio {checked} / {plain}: {b / a:.2f} (+{b - a:.3f} s)"]


@entry_point
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "r50.yaml")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "checksum_cpu.txt")
    args = parser.parse_args(argv)

    from deformable_detr.weights.files import (
        CHECKSUMS_KEY,
        read_metadata,
        tensor_checksums,
        verify_checksums,
        write_safetensors,
    )

    import mlx.core as mx

    folder = tempfile.TemporaryDirectory(dir=ROOT / "bench")  # on the disk the runs write to, not a tmpfs
    arrays, metadata = checkpoint_arrays(args.config, Path(folder.name))
    data_bytes = sum(v.nbytes for v in arrays.values())
    lines = [
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU: {cpu_model(count=True)}; "
        f"load average at start: {load_average()}",
        f"mlx {mx.__version__}; {args.config.name}: {len(arrays)} tensors (model and AdamW state"
        f"{', EMA' if any(k.startswith('ema.') for k in arrays) else ''}), {data_bytes / 2**20:.1f} MiB of data; "
        f"median of {args.repeats} alternating rounds after a warm-up each",
        "",
    ]
    with folder:
        plain, checked = Path(folder.name) / "plain.safetensors", Path(folder.name) / "checked.safetensors"
        times = alternate(
            {
                "without checksums": lambda: save_without_checksums(plain, arrays, metadata),
                "with checksums": lambda: write_safetensors(checked, arrays, metadata),
            },
            args.repeats,
        )
        lines += lines_of("save (hash, write, fsync, rename):", times)
        header = len(json.dumps(read_metadata(checked)))
        sizes = plain.stat().st_size, checked.stat().st_size
        lines.append(
            f"- file: {sizes[0]:,} bytes without, {sizes[1]:,} with (+{sizes[1] - sizes[0]:,}: the "
            f"{CHECKSUMS_KEY} metadata; the whole header's metadata {header:,} bytes)"
        )
        times = alternate(
            {"without the check": lambda: read_all(checked, False), "with the check": lambda: read_all(checked, True)},
            args.repeats,
        )
        lines += ["", *lines_of("read (mx.load, every tensor evaluated):", times)]
        hashing = alternate(
            {
                "hashing in memory (tensor_checksums)": lambda: tensor_checksums(arrays),
                "hashing the file (verify_checksums)": lambda: verify_checksums(checked, read_metadata(checked)),
            },
            args.repeats,
        )
        lines += ["", "the hashing alone:"]
        for name, rounds in hashing.items():
            median = statistics.median(rounds)
            lines.append(f"- {name}: {median:.3f} s, {data_bytes / median / 1e9:.2f} GB/s")
        one = memoryview(mx.view(arrays["model.transformer.level_embed"].reshape(-1), mx.uint8))
        block = bytes(one) * max(1, (64 << 20) // one.nbytes)  # 64 MiB: the hash's speed, not the memory's
        one_thread = alternate(
            {name: lambda name=name: hashlib.new(name, block).digest() for name in ("sha256", "blake2b")},
            args.repeats,
        )
        lines.append(
            "- one thread, 64 MiB: "
            + ", ".join(f"{n} {len(block) / statistics.median(t) / 1e9:.2f} GB/s" for n, t in one_thread.items())
        )
        lazy = alternate({"mx.load alone": lambda: mx.load(str(checked)), "": lambda: None}, args.repeats)
        lines.append(
            f"- mx.load alone (lazy: the header; what config lookups read, verify=False): "
            f"{statistics.median(lazy['mx.load alone']) * 1e3:.1f} ms"
        )
    report(lines, args.output)


if __name__ == "__main__":
    main()
