"""R50 inference with the weights' copies in oneDNN's layouts kept (a Detector's `kept_weights()` store)
against made at every call, alternating in one process, at each precision whose products are fast here.

    python bench/kept_weights.py [--repeats 8] [--output bench/results/kept_weights_cpu.txt]

configs/r50.yaml, random weights, batch 1 at 800 x 1066 (the authors' evaluation size); median of the rounds
after the first, seconds; and what the store holds.
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels  # noqa: E402, I001  (before mlx: the BLAS)
from deformable_detr.errors import ArgumentParser, entry_point  # noqa: E402

from common import RESULTS, cpu_model, instruction_caps, load_average, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@entry_point
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--output", type=Path, default=RESULTS / "kept_weights_cpu.txt")
    args = parser.parse_args(argv)
    from deformable_detr import build_model, load_config

    import mlx.core as mx
    import numpy as np

    cfg = load_config(ROOT / "configs" / "r50.yaml", ["model.dropout=0.0"])
    mx.random.seed(0)
    model = build_model(cfg)
    model.eval()
    mx.eval(model.parameters())
    x = mx.array(np.random.default_rng(0).standard_normal((1, 800, 1066, 3)).astype(np.float32))
    mask = mx.zeros((1, 800, 1066), mx.bool_)
    precisions = [mx.float32] + ([mx.bfloat16] if kernels.bfloat16_products()[0] else [])
    lines = [
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU: {cpu_model(count=True)}"
        f"{instruction_caps()}; load average at start: {load_average()}; {kernels.onednn.describe()}",
        f"R50 inference, 800 x 1066, batch 1; {args.repeats} alternating rounds, median of all but the first, seconds",
        "",
        "| products | weights' copies kept | made at every call | kept / made | copies kept |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for dtype in precisions:
        kept = kernels.onednn.kept_weights()
        times = {"kept": [], "made": []}
        for _ in range(args.repeats):
            for name, store in (("kept", kept), ("made", None)):
                with kernels.onednn.products_in(dtype, store):
                    start = time.perf_counter()
                    mx.eval(model(x, mask))
                    times[name].append(time.perf_counter() - start)
        k, m = (statistics.median(times[name][1:]) for name in ("kept", "made"))
        held = f"{kept.count}, {kept.bytes / 2**20:.0f} MiB" if kept is not None else "oneDNN not used"
        lines.append(f"| {str(dtype).split('.')[-1]} | {k:.3f} | {m:.3f} | {k / m:.3f} | {held} |")
    report(lines, args.output)


if __name__ == "__main__":
    main()
