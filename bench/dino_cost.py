"""What DINO costs against the authors' two-stage model and H-Deformable-DETR's, R50, in one run: the training step
(512 x 683, batch 2: its time and MLX's peak memory, with and without denoising) and inference (800 x 1066, batch
1), with a breakdown of DINO's extra inference time.

    python bench/dino_cost.py [--rounds 3] [--repeats 3] [--output bench/results/dino_cost_cpu.txt]

Rows (random weights: the cost does not depend on them; num_classes 91 everywhere):
  two-stage          configs/r50_two_stage.yaml (box refinement; FFN 1024, 300 queries)
  HDETR hybrid       configs/hdetr_r50_12ep.yaml (FFN 2048, 300 + 1,500 decoder queries in training)
  DINO, denoising    configs/dino_r50_4scale_12ep.yaml (FFN 2048, 900 queries + 200 denoising queries in training)
  DINO, no denoising the same with model.dn_number=0
Training: each row in a process of its own (its peak its own), the rows' processes alternating for --rounds rounds;
in each, --repeats steps after one warm-up (hdetr_cost.train_step: synthetic images, two boxes each, activation
checkpointing off). Inference, in this process, the models' forwards alternating for --rounds rounds of --repeats:
a forward and post_process with the config's top_k (DINO 300, the others 100), evaluated as Detector.detect does
(the detections only: the earlier layers' heads are not computed), and, beside, every output (aux_outputs and the
encoder's included). The breakdown times DINO's decoder parts alone on its encoder's real memory, at 900 and at 300
queries, alternating (at least 5 rounds), before the forwards.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels  # noqa: E402, F401  (before mlx: the BLAS)
from deformable_detr import build_model, load_config  # noqa: E402
from deformable_detr.models.deformable_detr import post_process  # noqa: E402
from deformable_detr.models.deformable_transformer import feed_forward  # noqa: E402
from deformable_detr.models.dino import box_sine_embedding  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from common import cpu_features, cpu_model, load_average, report  # noqa: E402
from hdetr_cost import train_steps  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DINO = "dino_r50_4scale_12ep"
TRAIN_ROWS = {
    "two-stage": ("r50_two_stage", []),
    "HDETR hybrid": ("hdetr_r50_12ep", []),
    "DINO, denoising (dn_number 100)": (DINO, []),
    "DINO, no denoising (dn_number 0)": (DINO, ["model.dn_number=0"]),
}
FEWER = ["model.num_queries=300", "evaluation.top_k=100"]  # the others' queries and detections
INFERENCE_ROWS = {
    "two-stage (FFN 1024, 300 queries)": ("r50_two_stage", []),
    "HDETR (FFN 2048, 300 queries)": ("hdetr_r50_12ep", []),
    "DINO (FFN 2048, 900 queries)": (DINO, []),
    "DINO, 300 queries": (DINO, FEWER),
    "DINO, 300 queries, FFN 1024": (DINO, FEWER + ["model.dim_feedforward=1024"]),
}
SIZE = (800, 1066)


def timed_rounds(calls: dict, rounds: int, repeats: int) -> dict:
    """name -> every timed call's seconds: one warm-up call each, then `rounds` rounds in which each name's call
    runs `repeats` times, the names alternating."""
    for call in calls.values():
        call()
    seconds = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            for _ in range(repeats):
                started = time.perf_counter()
                call()
                seconds[name].append(time.perf_counter() - started)
    return seconds


def training(rounds: int, repeats: int) -> tuple[dict, dict]:
    """-> (row -> every measured step's seconds, row -> the highest peak GiB of its processes)."""
    seconds, peaks = {name: [] for name in TRAIN_ROWS}, {name: 0.0 for name in TRAIN_ROWS}
    for _ in range(rounds):
        for name in TRAIN_ROWS:
            command = [sys.executable, __file__, "--train-row", name, "--repeats", str(repeats)]
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"error: the training row {name!r} failed:\n{done.stderr[-3000:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            seconds[name] += row["seconds"]
            peaks[name] = max(peaks[name], row["peak"])
            print(f"{name}: {', '.join(f'{s:.2f}' for s in row['seconds'])} s, peak {row['peak']:.2f} GiB", flush=True)
    return seconds, peaks


def train_row(name: str, repeats: int):
    """One training row, in this process: prints {"seconds": [each step's], "peak": GiB}."""
    config, overrides = TRAIN_ROWS[name]
    steps, peak = train_steps(config, overrides, repeats)
    print(json.dumps({"seconds": steps, "peak": peak}))


def models() -> dict:
    """name -> (model in eval, its top_k)."""
    built = {}
    for name, (config, overrides) in INFERENCE_ROWS.items():
        cfg = load_config(config, ["model.num_classes=91"] + overrides)
        mx.random.seed(0)
        model = build_model(cfg)
        model.eval()
        mx.eval(model.parameters())
        built[name] = (model, cfg.evaluation.top_k)
    return built


def inference(built: dict, rounds: int, repeats: int) -> tuple[dict, dict]:
    """-> (name -> seconds of a forward and post_process, the detections evaluated; name -> seconds of a forward,
    every output evaluated)."""
    images = mx.array(np.random.default_rng(0).standard_normal((1, *SIZE, 3)).astype(np.float32))
    mask = mx.zeros((1, *SIZE), dtype=mx.bool_)

    def detections(model, top_k):
        return lambda: mx.eval(post_process(model(images, mask), [SIZE], top_k))

    def everything(model):
        return lambda: mx.eval(model(images, mask))

    calls = {}
    for name, (model, top_k) in built.items():
        calls[("detections", name)] = detections(model, top_k)
        calls[("every output", name)] = everything(model)
    seconds = timed_rounds(calls, rounds, repeats)
    return (
        {name: statistics.median(seconds[("detections", name)]) for name in built},
        {name: statistics.median(seconds[("every output", name)]) for name in built},
    )


def decoder_parts(model, rounds: int, repeats: int) -> dict:
    """(part, queries) -> median seconds of that part of DINO's decoder and output, as often as a forward runs it
    (the layers' parts 6 times; the box head 6 times in the refinement and once on the output, the class head once:
    the detections' path), on the encoder's memory of one 800 x 1066 image."""
    images = mx.array(np.random.default_rng(0).standard_normal((1, *SIZE, 3)).astype(np.float32))
    mask = mx.zeros((1, *SIZE), dtype=mx.bool_)
    transformer = model.transformer
    memory, mask_flatten, spatial_shapes, valid_ratios = transformer.encode(*model.features(images, mask))
    mx.eval(memory, mask_flatten, valid_ratios)
    layer, decoder, d = transformer.decoder.layers[0], transformer.decoder, memory.shape[-1]
    layers = len(transformer.decoder.layers)
    ratios = mx.concatenate([valid_ratios, valid_ratios], -1)[:, None]
    calls, times_run = {}, {}
    for count in (900, 300):
        rng = np.random.default_rng(count)
        tgt = mx.array(rng.standard_normal((1, count, d)).astype(np.float32))
        pos = mx.array(rng.standard_normal((1, count, d)).astype(np.float32))
        boxes = mx.array(rng.uniform(0.1, 0.9, (1, count, 4)).astype(np.float32))
        points = boxes[:, :, None] * ratios
        mx.eval(tgt, pos, points)
        calls[("self-attention", count)] = lambda q=tgt + pos, v=tgt: mx.eval(layer.self_attn(q, q, v))
        calls[("cross-attention (deformable)", count)] = lambda q=tgt + pos, p=points: mx.eval(
            layer.cross_attn(q, p, memory, spatial_shapes, None, mask_flatten)
        )
        calls[(f"FFN ({layer.linear1.weight.shape[0]})", count)] = lambda t=tgt: mx.eval(
            feed_forward(layer, t, layer.norm3)
        )
        calls[("ref_point_head + box sine", count)] = lambda p=points: mx.eval(
            decoder.ref_point_head(box_sine_embedding(p[:, :, 0], d // 2))
        )
        calls[("box head (x 7)", count)] = lambda t=tgt: mx.eval(model.bbox_embed[0](t))
        calls[("class head (x 1)", count)] = lambda t=tgt: mx.eval(model.class_embed[0](t))
        logits = mx.array(rng.standard_normal((1, count, 91)).astype(np.float32))
        calls[(f"post_process (top {count // 3})", count)] = lambda lg=logits, b=boxes, k=count // 3: mx.eval(
            post_process({"pred_logits": lg, "pred_boxes": b}, [SIZE], k)
        )
        times_run.update({(part, count): layers for part, c in calls if c == count})
        times_run[("box head (x 7)", count)] = layers + 1
        times_run[("class head (x 1)", count)] = times_run[(f"post_process (top {count // 3})", count)] = 1
    seconds = timed_rounds(calls, rounds, repeats)
    return {key: statistics.median(times) * times_run[key] for key, times in seconds.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "dino_cost_cpu.txt")
    parser.add_argument("--train-row", help="(internal) measure this training row alone and print its JSON")
    parser.add_argument("--skip-training", action="store_true")
    args = parser.parse_args()
    if args.train_row:
        return train_row(args.train_row, args.repeats)
    loads = [f"at the start {load_average()}"]
    lines = [
        __doc__.split("\n\n")[0].replace("\n", " "),
        f"CPU: {cpu_model(count=True)} ({cpu_features()}); mlx {mx.__version__}; {time.strftime('%Y-%m-%d')}",
        "",
    ]
    if not args.skip_training:
        seconds, peaks = training(args.rounds, args.repeats)
        loads.append(f"after training {load_average()}")
        base = statistics.median(seconds["two-stage"])
        lines.append(
            f"{'training step, 512 x 683, batch 2':<36} {'s':>6} {'x':>6} {'peak GiB':>9}   "
            f"(median of {args.rounds} alternating processes x {args.repeats} steps; every step)"
        )
        for name, times in seconds.items():
            median = statistics.median(times)
            lines.append(
                f"{name:<36} {median:>6.2f} {median / base:>6.2f} {peaks[name]:>9.2f}   "
                + " ".join(f"{s:.2f}" for s in times)
            )
        lines.append("")
    built = models()
    # the parts first: after the five models' forwards (their freed buffers cached) they timed erratically here
    parts = decoder_parts(built["DINO (FFN 2048, 900 queries)"][0], max(args.rounds, 5), args.repeats)
    loads.append(f"after the decoder's parts {load_average()}")
    detections, everything = inference(built, args.rounds, args.repeats)
    loads.append(f"after inference {load_average()}")
    base = detections["two-stage (FFN 1024, 300 queries)"]
    lines.append(
        f"{'inference, 800 x 1066, batch 1':<36} {'s':>6} {'x':>6} {'every output s':>15}   "
        f"(median of {args.rounds} alternating rounds x {args.repeats}; detections: as Detector.detect)"
    )
    for name in built:
        lines.append(f"{name:<36} {detections[name]:>6.2f} {detections[name] / base:>6.2f} {everything[name]:>15.2f}")
    two_stage, dino, fewer, narrower = (detections[name] for name in built if name.startswith(("two", "DINO")))
    lines += [
        f"DINO's {dino - two_stage:.2f} s over the two-stage's: its 900 queries {dino - fewer:.2f} s (against 300), "
        f"its FFN 2048 {fewer - narrower:.2f} s (against 1024), the rest {narrower - two_stage:.2f} s (ref_point_head "
        "and the box sine at every layer, the decoder's norm, the proposals' best class)",
        "",
        f"DINO's decoder parts alone, 6 layers, on the encoder's memory of one {SIZE[0]} x {SIZE[1]} image "
        f"(median, alternating):",
        f"{'part':<36} {'900 queries s':>14} {'300 queries s':>14} {'difference':>11}",
    ]
    many_parts = [(part, s) for (part, count), s in parts.items() if count == 900]
    few_parts = [s for (_, count), s in parts.items() if count == 300]
    for (part, many), few in zip(many_parts, few_parts, strict=True):
        lines.append(f"{part.replace('top 300', 'top 300 / 100'):<36} {many:>14.3f} {few:>14.3f} {many - few:>11.3f}")
    total_many = sum(s for (_, count), s in parts.items() if count == 900)
    total_few = sum(s for (_, count), s in parts.items() if count == 300)
    lines.append(f"{'sum':<36} {total_many:>14.3f} {total_few:>14.3f} {total_many - total_few:>11.3f}")
    lines += ["", "load average: " + "; ".join(loads) + f"; at the end {load_average()}"]
    report(lines, args.output)


if __name__ == "__main__":
    main()
