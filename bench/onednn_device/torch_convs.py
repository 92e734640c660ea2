# ruff: noqa: B023, B905, E501  (a device script: closures timed in their loop, as written)
"""PyTorch reference for bench's `train` and `infer` modes: the same ResNet-50 convolutions (torch's CPU
convolutions are oneDNN too), on torch.set_num_threads(THREADS, default 2), channels_last.

  train: batch 2, 512 x 683; stem + layer1 forward only, layer2-4 forward + input grad + weight grad
         (each grad timed alone: torch.autograd.grad(y, x) and (y, w) on a retained graph)
  infer: batch 1, 800 x 1066, forward under torch.no_grad()
  modes: f32 (float32 tensors); autocast (float32 tensors under torch.autocast("cpu", bfloat16): x and w
         cast to bf16 at every call, bf16 results, the grads cast back to f32); bf16 (bfloat16 x and w)

Env: REPEATS (timed calls after one warm-up, default 5), MAX_S (stop repeating a call after this many
seconds, at least 2 calls; default 1), SIZE / INFER_SIZE=n,h,w, MODES / INFER_MODES (comma lists).
Usage: python torch_convs.py [train] [infer]
"""

import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

REPEATS = max(1, int(os.environ.get("REPEATS", "5")))
MAX_S = float(os.environ.get("MAX_S", "1.0"))


def resnet50(H, W):
    """[name, count, c, o, k, stride, pad, h, w, train, data_needed] per distinct conv (as bench.cpp)."""
    layers = []

    def add(name, c, o, k, stride, h, w, train, needed):
        for layer in layers:
            if layer[2:6] == [c, o, k, stride] and layer[7:] == [h, w, train, needed]:
                layer[1] += 1
                return
        layers.append([name, 1, c, o, k, stride, k // 2, h, w, train, needed])

    def out(x, k, s, p):
        return (x + 2 * p - k) // s + 1

    add("stem 7x7 3-64 s2", 3, 64, 7, 2, H, W, False, False)
    h, w = out(out(H, 7, 2, 3), 3, 2, 1), out(out(W, 7, 2, 3), 3, 2, 1)
    inc = 64
    for stage, (c, depth) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3))):
        stride, train = (1 if stage == 0 else 2), stage > 0
        for b in range(depth):
            s = stride if b == 0 else 1
            needed = train and not (stage == 1 and b == 0)
            h2, w2 = out(h, 3, s, 1), out(w, 3, s, 1)
            L, s2 = f"L{stage + 1} ", " s2" if s > 1 else ""
            add(f"{L}1x1 {inc}-{c} @{h}x{w}", inc, c, 1, 1, h, w, train, needed)
            add(f"{L}3x3 {c}-{c}{s2} @{h}x{w}", c, c, 3, s, h, w, train, True)
            add(f"{L}1x1 {c}-{4 * c} @{h2}x{w2}", c, 4 * c, 1, 1, h2, w2, train, True)
            if b == 0:
                add(f"{L}ds 1x1 {inc}-{4 * c}{s2} @{h}x{w}", inc, 4 * c, 1, s, h, w, train, needed)
            h, w, inc = h2, w2, 4 * c
    return layers


def time_calls(f):
    f()
    times, start = [], time.perf_counter()
    while len(times) < max(2, REPEATS) and (
        len(times) < 2 or (len(times) < REPEATS and time.perf_counter() - start < MAX_S)
    ):
        a = time.perf_counter()
        f()
        times.append(time.perf_counter() - a)
    if REPEATS == 1:
        times = times[:1]
    return statistics.median(times), min(times)


def network(what, mode, n, H, W, training):
    cl = torch.channels_last
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else None
    print(f"== torch {what} {mode}: batch {n}, {H} x {W}; ms per call (median; count in the sum)", flush=True)
    print(f"   {'conv':<30} {'n':>3} {'fwd':>9} {'bwd_data':>9} {'bwd_w':>9}", flush=True)
    total, best = [0.0] * 3, [0.0] * 3
    flops, unneeded = [0.0] * 3, 0.0
    for name, count, c, o, k, stride, pad, h, w, train, needed in resnet50(H, W):
        backward = training and train
        x = torch.randn(n, c, h, w).to(dtype=dtype, memory_format=cl).requires_grad_(backward)
        wt = (torch.randn(o, c, k, k) * 0.05).to(dtype=dtype, memory_format=cl).requires_grad_(backward)

        def forward():
            if cast is not None:
                with torch.autocast("cpu", dtype=torch.bfloat16):  # entered per call: no cast cache across calls
                    return F.conv2d(x, wt, None, stride, pad)
            return F.conv2d(x, wt, None, stride, pad)

        oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
        fl = 2.0 * n * oh * ow * o * c * k * k
        ms = [None] * 3
        if training:
            t = time_calls(forward)
        else:
            with torch.no_grad():
                t = time_calls(forward)
        results = [t]
        if backward:
            y = forward()
            g = torch.randn_like(y)
            results.append(time_calls(lambda: torch.autograd.grad(y, x, g, retain_graph=True)))
            results.append(time_calls(lambda: torch.autograd.grad(y, wt, g, retain_graph=True)))
            del y, g
        for p, (med, mn) in enumerate(results):
            ms[p] = med * 1e3
            total[p] += med * count
            best[p] += mn * count
            flops[p] += fl * count
            if p == 1 and not needed:
                unneeded += med * count
        cells = " ".join(f"{v:9.2f}" if v is not None else f"{'-':>9}" for v in ms)
        note = "  (bwd_data not needed)" if backward and not needed else ""
        print(f"   {name:<30} x{count:<2} {cells}{note}", flush=True)
    names = ("fwd", "bwd_data", "bwd_weights")
    for p in range(3 if training else 1):
        rate = flops[p] / total[p] / 1e9 if total[p] else 0.0
        print(
            f"-- torch {what} {mode} {names[p]:<11} {total[p] * 1e3:8.1f} ms (best {best[p] * 1e3:8.1f})"
            f" {flops[p] / 1e9:6.1f} GFLOP {rate:5.0f} GFLOP/s",
            flush=True,
        )
    if training:
        print(
            f"-- torch {what} {mode} bwd_data not needed (layer2.0 conv1 + downsample): {unneeded * 1e3:.1f} ms;"
            f" total needed {(sum(total) - unneeded) * 1e3:.1f} ms"
        )
    print(f"== torch {what} {mode} TOTAL {sum(total) * 1e3:.1f} ms (best {sum(best) * 1e3:.1f})\n", flush=True)


def main():
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    capability = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", lambda: "?")()
    onednn = next((line.strip() for line in torch.__config__.show().splitlines() if "DNN" in line), "?")
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, mkldnn {torch.backends.mkldnn.is_available()},"
        f" cpu capability {capability}, {onednn}; REPEATS={REPEATS}, MAX_S={MAX_S}",
        flush=True,
    )
    parts = sys.argv[1:] or ["train", "infer"]
    if "train" in parts:
        n, h, w = (int(v) for v in os.environ.get("SIZE", "2,512,683").split(","))
        for mode in os.environ.get("MODES", "f32,autocast,bf16").split(","):
            network("train", mode, n, h, w, True)
    if "infer" in parts:
        n, h, w = (int(v) for v in os.environ.get("INFER_SIZE", "1,800,1066").split(","))
        for mode in os.environ.get("INFER_MODES", "f32,autocast").split(","):
            network("infer", mode, n, h, w, False)


if __name__ == "__main__":
    main()
