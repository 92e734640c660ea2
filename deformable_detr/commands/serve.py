"""Serve a model over HTTP: detections as JSON, images of concurrent requests run as one batch.

    deformable-detr serve --checkpoint W [--config C] [--raw-weights] [--precision P] [--host 127.0.0.1]
        [--port 8000] [--max-batch 8] [--max-wait-ms 10] [--max-queue 64] [--max-body-mb 20]
        [--max-megapixels 128] [--max-slices 1024] [--read-timeout-s 10] [--shutdown-timeout-s 20]
        [section.key=value ...]

(also `python -m deformable_detr.serve`). W: any weights `Detector.load` takes (a checkpoint, converted
weights, hf://ORG/NAME); the config overrides are written as in every command. The routes
(POST /v1/detect, GET /v1/model, /v1/stats, /healthz, the page at /) are deformable_detr/serving/app.py's.
It listens on this machine alone unless --host says otherwise; there is no authentication. What a client
can hold is bounded: a connection whose headers are not all in within --read-timeout-s, or whose body
stalls that long between two chunks, is closed (counted in /v1/stats' timeouts); the images held decoded at
once (decoding, queued, in a forward) count at most --max-megapixels, reserved from their headers before
decoding (503 with Retry-After while others hold the budget, 413 for a request over all of it); a sliced
request's images (?slice=W,H) count at most --max-slices slices, from their headers (400 beyond). SIGTERM or
Ctrl-C: new requests are refused, those under way complete within --shutdown-timeout-s (then they are
cancelled and the process ends after the forward under way), exit status 0. Needs the `serve` extra."""

import ipaddress
import signal
import sys

from ..errors import CommandError, UsageError, entry_point, optional
from .cli import add_model_arguments, command_parser, load_detector, split_overrides


def build_parser():
    """serve's parser (docs/commands.md is generated from it)."""
    parser = command_parser("serve", __doc__)
    add_model_arguments(parser, precision="auto")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch", type=int, default=8, help="images a forward, at most")
    parser.add_argument("--max-wait-ms", type=float, default=10, help="how long an image waits for others to join")
    parser.add_argument("--max-queue", type=int, default=64, help="images waiting, at most; more: 503 Retry-After")
    parser.add_argument("--max-body-mb", type=float, default=20, help="a request's body, at most (413 beyond)")
    parser.add_argument(
        "--max-megapixels",
        type=float,
        default=128,
        help="decoded pixels held at once, in millions (8 bytes each while decoding; with alpha or 16 bits 3 "
        "times, 32 bits 5); 503 while other requests hold them, 413 for a request over all of them",
    )
    parser.add_argument(
        "--max-slices", type=int, default=1024, help="slices a request's images may ask for (?slice=W,H); 400 beyond"
    )
    parser.add_argument(
        "--read-timeout-s", type=float, default=10, help="a request's headers, and each gap in its body, at most"
    )
    parser.add_argument(
        "--shutdown-timeout-s", type=float, default=20, help="after SIGTERM, how long requests under way may take"
    )
    return parser


def parse_args(argv=None):
    args = build_parser().parse_intermixed_args(argv)  # overrides before and after the options
    args.overrides = split_overrides(args.overrides)[0]
    least_ones = [
        ("--max-batch", args.max_batch, 1),
        ("--max-queue", args.max_queue, 1),
        ("--max-slices", args.max_slices, 1),
    ]
    for option, value, least in least_ones:
        if value < least:
            raise UsageError(f"{option} {value}: must be at least {least}")
    if args.max_wait_ms < 0 or args.max_body_mb <= 0 or not 0 <= args.port <= 65535:
        raise UsageError("--max-wait-ms must be at least 0, --max-body-mb above 0 and --port 0 to 65535")
    for option in ("--max-megapixels", "--read-timeout-s", "--shutdown-timeout-s"):
        value = getattr(args, option[2:].replace("-", "_"))
        if not 0 < value < float("inf"):
            raise UsageError(f"{option} {value:g}: must be a finite number above 0")
    return args


def server_modules():
    """(uvicorn, create_app, with_header_deadline), or a CommandError naming the extra that installs them."""
    uvicorn = optional("uvicorn", "serve", "serve")
    optional("starlette", "serve", "serve")
    optional("multipart", "serve", "serve")  # python-multipart: the page's uploads
    from ..serving.app import create_app
    from ..serving.connections import with_header_deadline

    return uvicorn, create_app, with_header_deadline


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def stop_quietly(signum, frame):
    """After uvicorn's graceful shutdown it raises the signal it caught again: exit 0, not killed by it."""
    raise SystemExit(0)


@entry_point
def main(argv=None):
    args = parse_args(argv)
    uvicorn, create_app, with_header_deadline = server_modules()
    detector = load_detector(args)
    app = create_app(
        detector,
        args.max_batch,
        args.max_wait_ms,
        args.max_queue,
        args.max_body_mb,
        max_megapixels=args.max_megapixels,
        read_timeout=args.read_timeout_s,
        max_slices=args.max_slices,
    )
    if not is_loopback(args.host):
        print(
            f"listening on {args.host}:{args.port}, beyond this machine: whoever reaches it can use the model "
            "(no authentication; --host 127.0.0.1 keeps it here)",
            file=sys.stderr,
        )
    # The h11 protocol, whatever else is installed (httptools): the header deadline is written for it.
    protocol = with_header_deadline(args.read_timeout_s, app.state.service.count_timeout)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="info",
        http=protocol,
        timeout_graceful_shutdown=args.shutdown_timeout_s,
    )
    server = uvicorn.Server(config)
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, stop_quietly)
    server.run()
    if not server.started:
        raise CommandError(f"could not serve on {args.host}:{args.port} (uvicorn's line above says why)")


if __name__ == "__main__":
    main()
