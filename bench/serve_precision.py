"""The server under a steady load at each `--precision`: requests/s, latency and its resident memory, round after
round, on the val set's mixed sizes (issue 73: at `auto`, bfloat16 on a CPU with AMX or AVX512-BF16, the server
had served 27% fewer requests than at float32 and grown 1.5 GB in a minute).

    python bench/serve_precision.py [--checkpoint output/shapes/checkpoint.safetensors] [--images data/shapes/val2017]
                                    [--clients 12] [--rounds 4] [--seconds 20] [--precisions auto,float32]
                                    [--tree DIR --tree-name NAME ...] [--output bench/results/serve_precision_cpu.txt]

For each code tree (this checkout, and each `--tree`, another checkout with its extension built in place,
`python setup.py build_ext --inplace`: the code before a change, run from its own folder) and each precision:
`python -m deformable_detr.serve --precision P` (batching as its defaults) in its own process, `--clients` threads
each posting the next val image (its 100 images cycled, each client from its own start) as soon as its answer came,
for `--rounds` rounds of `--seconds`: each round's requests/s, p50 and p95 latency, the mean forward batch
(/v1/stats), and the server's resident memory (VmRSS) after the warm-up and after each round. Flat after the first
round is what a server that keeps nothing per request shows."""

import os
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, load_average, report  # noqa: E402
from serve import resident_mib, running_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=ROOT / "output" / "shapes" / "checkpoint.safetensors")
    parser.add_argument("--images", type=Path, default=ROOT / "data" / "shapes" / "val2017")
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--precisions", default="auto,float32", help="comma-separated")
    parser.add_argument("--tree", type=Path, action="append", default=[], help="another checkout to run first")
    parser.add_argument("--tree-name", action="append", default=[], help="a name for each --tree (e.g. before)")
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "serve_precision_cpu.txt")
    args = parser.parse_args(argv)
    if len(args.tree_name) != len(args.tree):
        parser.error("give one --tree-name for each --tree")
    return args


def one_round(url: str, bodies: list[bytes], clients: int, seconds: float) -> tuple[float, list[float]]:
    """`clients` threads posting for `seconds` -> (requests/s, latencies in seconds)."""
    stop = time.perf_counter() + seconds
    latencies = [[] for _ in range(clients)]

    def client(c):
        with httpx.Client(timeout=120) as session:
            i = c * len(bodies) // clients
            while time.perf_counter() < stop:
                sent = time.perf_counter()
                answer = session.post(f"{url}/v1/detect", content=bodies[i % len(bodies)], params={"threshold": 0.3})
                if answer.status_code != 200:
                    raise SystemExit(f"error: {answer.status_code} {answer.text}")
                latencies[c].append(time.perf_counter() - sent)
                i += 1

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done = [t for part in latencies for t in part]
    return len(done) / (time.perf_counter() - start), done


def measure(url: str, server, bodies, args) -> list[str]:
    lines = [
        "| round | requests/s | p50 ms | p95 ms | mean batch | resident MiB |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines.append(f"| warm-up | | | | | {resident_mib(server.pid):.0f} |")
    for number in range(1, args.rounds + 1):
        before = httpx.get(f"{url}/v1/stats").json()
        rate, latencies = one_round(url, bodies, args.clients, args.seconds)
        after = httpx.get(f"{url}/v1/stats").json()
        batch = (after["images"] - before["images"]) / max(after["batches"] - before["batches"], 1)
        p50, p95 = (1000 * q for q in statistics.quantiles(latencies, n=20)[9::9][:2])
        lines.append(
            f"| {number} | {rate:.1f} | {p50:.0f} | {p95:.0f} | {batch:.2f} | {resident_mib(server.pid):.0f} |"
        )
        print(lines[-1], flush=True)
    return lines


def main(argv=None):
    args = parse_args(argv)
    if not args.checkpoint.is_file():
        sys.exit(f"error: {args.checkpoint} does not exist: train the quick start's model first")
    bodies = [path.read_bytes() for path in sorted(args.images.iterdir())]
    trees = [*zip(args.tree_name, args.tree, strict=True), ("this checkout", ROOT)]
    lines = [
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU: {cpu_model(count=True)}; "
        f"load average at start: {load_average()}",
        f"model: {os.path.relpath(args.checkpoint, ROOT)}; images: {os.path.relpath(args.images, ROOT)} "
        f"({len(bodies)}, mixed sizes); {args.clients} clients, {args.rounds} rounds of {args.seconds:.0f} s",
        f"command: python bench/serve_precision.py {' '.join(argv if argv is not None else sys.argv[1:])}",
        "",
    ]
    url = f"http://127.0.0.1:{args.port}"
    for name, tree in trees:
        for precision in args.precisions.split(","):
            with running_server(args.checkpoint, args.port, ["--precision", precision], tree) as (server, printed):
                said = next((line.strip() for line in printed if "precision" in line), "precision: (not printed)")
                print(f"## {name}, --precision {precision}: {said}", flush=True)
                lines += [f"## {name}, --precision {precision}", "", f"the server: {said}", ""]
                lines += [*measure(url, server, bodies, args), ""]
    lines.append(f"load average at the end: {load_average()}")
    report(lines, args.output)


if __name__ == "__main__":
    main()
