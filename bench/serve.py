"""The detection server under a bounded load on loopback, with batching and without.

    python bench/serve.py [--checkpoint output/shapes/checkpoint.safetensors] [--images data/shapes/val2017]
                          [--requests 200] [--clients 1,4,8] [--output bench/results/serve_cpu.txt]

The quick start's model (train it first: `python train.py --config configs/shapes.yaml`) served by
`python -m deformable_detr.serve` in its own process, twice: batching (`--max-batch 8 --max-wait-ms 5`)
and not (`--max-batch 1 --max-wait-ms 0`). For each, `--requests` POST /v1/detect at each number of
concurrent clients (threads of httpx clients, each sending its next request when its answer came), on
images of one size (one val image: what a camera sends; they can share a forward) and on the val set's
mixed sizes (only images of one resized size share one): requests/s, p50 and p95 latency, the mean
forward batch (`/v1/stats`), and the server's resident memory after its warm-up and after each round
(no growth: what a request leaves behind would show here)."""

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, load_average, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "batching": ["--max-batch", "8", "--max-wait-ms", "5"],
    "one at a time": ["--max-batch", "1", "--max-wait-ms", "0"],
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=ROOT / "output" / "shapes" / "checkpoint.safetensors")
    parser.add_argument("--images", type=Path, default=ROOT / "data" / "shapes" / "val2017")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", default="1,4,8", help="concurrent clients, comma-separated")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "serve_cpu.txt")
    return parser.parse_args(argv)


def resident_mib(pid: int) -> float:
    """The process's resident memory (VmRSS), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@contextmanager
def running_server(checkpoint: Path, port: int, options: list, tree: Path = ROOT):
    """`python -m deformable_detr.serve` of `tree`'s code (run from that folder, which puts it first on the path:
    another checkout, to measure the code before a change) with `options`, once it answers: (the process, the
    lines it prints, stdout and stderr, a list that grows as it prints); stopped (SIGTERM) when the block ends."""
    command = [sys.executable, "-m", "deformable_detr.serve", "--checkpoint", str(checkpoint.resolve())]
    env = dict(os.environ, PYTHONPATH=str(tree))
    server = subprocess.Popen(
        [*command, "--port", str(port), *options],
        cwd=tree,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    printed = []
    threading.Thread(target=lambda: printed.extend(server.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + 300
        while not ready(port):
            if time.monotonic() > deadline:
                sys.exit("error: the server did not become ready in 5 minutes:\n" + "".join(printed[-20:]))
            time.sleep(0.5)
        yield server, printed
    finally:
        server.terminate()
        server.wait(timeout=120)


def ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def load(url: str, bodies: list[bytes], requests: int, clients: int) -> tuple[float, list[float]]:
    """`requests` POSTs from `clients` threads, each sending the next body when its answer came ->
    (requests/s, each request's latency in seconds). Any answer but 200 stops the script."""

    def client(indices):
        latencies = []
        with httpx.Client(timeout=120) as session:
            for i in indices:
                sent = time.perf_counter()
                answer = session.post(f"{url}/v1/detect", content=bodies[i % len(bodies)], params={"threshold": 0.3})
                if answer.status_code != 200:
                    sys.exit(f"error: {answer.status_code} {answer.text}")
                latencies.append(time.perf_counter() - sent)
        return latencies

    shares = [range(c, requests, clients) for c in range(clients)]
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        latencies = [t for part in pool.map(client, shares) for t in part]
    return requests / (time.perf_counter() - start), latencies


def rounds(url: str, server, sets: dict, requests: int, clients: list[int]) -> list[str]:
    lines, memory = [], [f"{resident_mib(server.pid):.0f}"]
    for set_name, bodies in sets.items():
        for count in clients:
            before = httpx.get(f"{url}/v1/stats").json()
            rate, latencies = load(url, bodies, requests, count)
            after = httpx.get(f"{url}/v1/stats").json()
            mean_batch = (after["images"] - before["images"]) / max(after["batches"] - before["batches"], 1)
            p50, p95 = (1000 * q for q in statistics.quantiles(latencies, n=20)[9::9][:2])
            lines.append(f"| {set_name} | {count} | {rate:.1f} | {p50:.0f} | {p95:.0f} | {mean_batch:.2f} |")
            memory.append(f"{resident_mib(server.pid):.0f}")
    return lines + [f"resident MiB after the warm-up, then after each round: {' -> '.join(memory)}"]


def main(argv=None):
    args = parse_args(argv)
    if not args.checkpoint.is_file():
        sys.exit(f"error: {args.checkpoint} does not exist: train the quick start's model first")
    paths = sorted(args.images.iterdir())
    sets = {"one size": [paths[0].read_bytes()], "mixed sizes": [path.read_bytes() for path in paths]}
    clients = [int(c) for c in args.clients.split(",")]
    lines = [
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU: {cpu_model(count=True)}; "
        f"load average at start: {load_average()}",
        f"model: {args.checkpoint}; images: {args.images} ({len(paths)}); {args.requests} requests a round",
        "",
    ]
    for mode, options in MODES.items():
        url = f"http://127.0.0.1:{args.port}"
        with running_server(args.checkpoint, args.port, options) as (server, _):
            lines += [
                f"## {mode} ({' '.join(options)})",
                "",
                "| images | clients | requests/s | p50 ms | p95 ms | mean batch |",
                "| --- | ---: | ---: | ---: | ---: | ---: |",
                *rounds(url, server, sets, args.requests, clients),
                "",
            ]
    lines.append(f"load average at the end: {load_average()}")
    report(lines, args.output)


if __name__ == "__main__":
    main()
