"""The detection server's Starlette app: `create_app(detector, ...)`.

    POST /v1/detect  an image as the body, or several as multipart/form-data (each file part an image);
                     query threshold (0.5), attention (0/1/false/true), attention_layer (-1)
                     -> {"model", "image": {"width", "height"}, "detections": [Detections.to_json()]}
                        or {"model", "results": [{"filename", "image", "detections"}, ...]};
                        header X-Batch-Size: the forward batch the (first) image ran in
    GET /v1/model    the model: name, classes, queries, layers, heads, levels, points, val_size, max_size
    GET /v1/stats    requests, images, batches, batch_sizes {size: count}, queued, errors
    GET /healthz     200 {"status": "ok"} once the model has run a warm-up forward, else 503
    GET /            static/index.html (the page), where it is there

Every error is a one-line JSON {"error": "..."} with its status: 400 a bad query value or an empty body,
413 a body over max_body_mb or an image over Pillow's pixel limit, 415 not an image, 422 an image whose
data is truncated or corrupt, 503 a full queue (with Retry-After) or a server shutting down."""

import asyncio
import contextlib
import math
from pathlib import Path

import mlx.core as mx
from PIL import Image
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse
from starlette.routing import Route

from .batcher import Batcher, Closed, QueueFull
from .uploads import ClientError, decode

PAGE = Path(__file__).parent / "static" / "index.html"
RETRY_AFTER_S = 1  # what a 503 for a full queue asks the client to wait
TRUE, FALSE = ("1", "true"), ("0", "false")
QUERY_KEYS = ("threshold", "attention", "attention_layer")


def create_app(
    detector, max_batch: int = 8, max_wait_ms: float = 10, max_queue: int = 64, max_body_mb: float = 20, name=None
) -> Starlette:
    """The app serving `detector` (`Detector`); `name`: the model's name in answers (default: its
    weights' file or hf:// name). The batcher's worker starts (and warms up) with the app's lifespan
    and, at shutdown, runs what is queued before it stops."""
    service = DetectionService(detector, max_batch, max_wait_ms / 1000, max_queue, max_body_mb, name)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.batcher.start(service.warm_up)
        yield
        await run_in_threadpool(service.batcher.close)

    routes = [
        Route("/", service.page),
        Route("/healthz", service.health),
        Route("/v1/model", service.model),
        Route("/v1/stats", service.stats),
        Route("/v1/detect", service.detect, methods=["POST"]),
    ]
    handlers = {HTTPException: http_error, Exception: server_error}
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
    app.state.service = service
    return app


def error(status: int, message: str, headers=None) -> JSONResponse:
    return JSONResponse({"error": " ".join(str(message).splitlines())}, status, headers)


async def http_error(request, exc: HTTPException) -> JSONResponse:
    return error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")


async def server_error(request, exc: Exception) -> JSONResponse:
    return error(500, f"{type(exc).__name__}: {exc}")


class DetectionService:
    """The routes' handlers over one `Detector` and its `Batcher`, with the counts /v1/stats reports."""

    def __init__(self, detector, max_batch, max_wait, max_queue, max_body_mb, name=None):
        self.detector, self.max_body = detector, int(max_body_mb * 1024 * 1024)
        # Loaded weights may still be lazy on the loading thread's MLX stream, which the worker cannot use:
        # computed here, on that thread (MLX streams belong to the thread that made them).
        mx.eval(detector.model.parameters())
        self.name = name or model_name(detector.source)
        self.batcher = Batcher(self.run, max_batch, max_wait, max_queue)
        self.requests = self.images = self.errors = 0

    def warm_up(self) -> None:
        """On the worker, before any batch: its own MLX stream (another thread's cannot run there; without
        one MLX aborts the process), then one forward on a small image, so the first request does not pay
        for MLX's first run."""
        mx.set_default_stream(mx.new_stream(mx.default_device()))
        self.detector.predict(Image.new("RGB", (64, 48), (127, 127, 127)), threshold=1.0)

    def run(self, images: list, key: tuple) -> list:
        """One batch, on the worker: images of one resized shape (no padding, so no image's answer depends
        on another's size) and one attention layer. Threshold 0 here and each request's own threshold
        after (`Detections.at_threshold`): requests asking different thresholds still share the forward, and the kept
        detections are those `predict` keeps at that threshold (the same ones, best first)."""
        _, layer = key
        attention = layer is not None
        return self.detector.predict(
            images,
            threshold=0.0,
            attention=attention,
            attention_layer=layer if attention else -1,
            batch_size=len(images),
        )

    async def detect(self, request: Request) -> JSONResponse:
        self.requests += 1
        try:
            response = await self._detect(request)
        except ClientError as failure:
            response = error(failure.status, failure)
        except QueueFull as full:
            response = error(503, full, {"Retry-After": str(RETRY_AFTER_S)})
        except Closed as closed:
            response = error(503, closed)
        except Exception as failure:  # noqa: BLE001  (the model failed on this batch: 500; the server goes on)
            response = await server_error(request, failure)
        if response.status_code >= 400:
            self.errors += 1
        return response

    async def _detect(self, request: Request) -> JSONResponse:
        threshold, layer = detect_options(request.query_params, self.detector.cfg.model.dec_layers)
        body = await read_body(request, self.max_body)
        content_type = request.headers.get("content-type", "")
        uploads = await form_files(request, body) if content_type.startswith("multipart/form-data") else None
        named = uploads if uploads is not None else [("the body", body)]
        if len(named) > self.batcher.max_queue:
            raise ClientError(
                413, f"{len(named)} images in one request: at most {self.batcher.max_queue} (--max-queue)"
            )
        images = [await run_in_threadpool(decode, data, filename) for filename, data in named]
        keys = [(self.detector.batch_key(image), layer) for image in images]
        futures = self.batcher.submit(list(zip(images, keys, strict=True)))
        answers = await asyncio.gather(*(asyncio.wrap_future(future) for future in futures))
        self.images += len(images)
        found = [(detections.at_threshold(threshold), size) for detections, size in answers]
        headers = {"X-Batch-Size": str(found[0][1])}
        if uploads is None:
            return JSONResponse({"model": self.name, **one_result(found[0][0])}, headers=headers)
        results = [{"filename": filename, **one_result(d)} for (filename, _), (d, _) in zip(named, found, strict=True)]
        return JSONResponse({"model": self.name, "results": results}, headers=headers)

    async def model(self, request: Request) -> JSONResponse:
        model, data = self.detector.cfg.model, self.detector.cfg.data
        return JSONResponse(
            {
                "name": self.name,
                "classes": {str(k): v for k, v in sorted(self.detector.class_names.items())},
                "num_queries": model.num_queries,
                "decoder_layers": model.dec_layers,
                "encoder_layers": model.enc_layers,
                "heads": model.nheads,
                "levels": model.num_feature_levels,
                "points": model.dec_n_points,
                "val_size": data.val_size,
                "max_size": data.max_size,
            }
        )

    async def stats(self, request: Request) -> JSONResponse:
        sizes = dict(sorted(self.batcher.batch_sizes.items()))
        return JSONResponse(
            {
                "requests": self.requests,
                "images": self.images,
                "batches": sum(sizes.values()),
                "batch_sizes": {str(size): count for size, count in sizes.items()},
                "queued": self.batcher.queued,
                "errors": self.errors,
            }
        )

    async def health(self, request: Request) -> JSONResponse:
        if self.batcher.ready.is_set():
            return JSONResponse({"status": "ok"})
        return error(503, "the model is not ready: loading or warming up")

    async def page(self, request: Request):
        if PAGE.is_file():
            return FileResponse(PAGE, media_type="text/html")
        return error(404, "no page: deformable_detr/serving/static/index.html is not there (the API is under /v1/)")


def detect_options(query, decoder_layers: int) -> tuple[float, int | None]:
    """-> (threshold, the decoder layer whose sampling points are asked, 0 to layers - 1, or None)."""
    unknown = sorted(set(query) - set(QUERY_KEYS))
    if unknown:
        raise ClientError(400, f"unknown query parameter {unknown[0]!r}: expected {', '.join(QUERY_KEYS)}")
    try:
        threshold = float(query.get("threshold", "0.5"))
    except ValueError:
        threshold = math.nan
    if not math.isfinite(threshold):
        raise ClientError(400, f"threshold {query['threshold']!r}: expected a number")
    attention = query.get("attention", "0").lower()
    if attention not in TRUE + FALSE:
        raise ClientError(400, f"attention {query['attention']!r}: expected 1, true, 0 or false")
    layer = query.get("attention_layer", "-1")
    if not layer.lstrip("-").isdigit() or not -decoder_layers <= int(layer) < decoder_layers:
        layers = f"{decoder_layers} decoder layers (0 to {decoder_layers - 1}, or -1: the last)"
        raise ClientError(400, f"attention_layer {layer!r}: the model has {layers}")
    return threshold, int(layer) % decoder_layers if attention in TRUE else None


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) before it is read where Content-Length is over `limit` bytes, else as soon
    as what has come passes it."""
    declared = request.headers.get("content-length", "")
    too_big = f"the body is over the server's limit of {limit / 1024 / 1024:g} MB (--max-body-mb)"
    if declared.isdigit() and int(declared) > limit:
        raise ClientError(413, too_big)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ClientError(413, too_big)
        chunks.append(chunk)
    if not size:
        raise ClientError(400, "the body is empty: send an image, or several as multipart/form-data")
    return b"".join(chunks)


async def form_files(request: Request, body: bytes) -> list[tuple[str, bytes]]:
    """(filename, bytes) of each file part of the multipart `body` (already read), in order."""

    async def replay():
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        async with Request(request.scope, replay).form() as form:
            files = [
                (part.filename or key, await part.read())
                for key, part in form.multi_items()
                if isinstance(part, UploadFile)
            ]
    except (HTTPException, ValueError) as failure:  # python-multipart's parse errors
        raise ClientError(400, f"a malformed multipart/form-data body: {getattr(failure, 'detail', failure)}") from None
    if not files:
        raise ClientError(400, "the multipart/form-data body has no file part: each image is one")
    return files


def one_result(detections) -> dict:
    width, height = detections.image_size
    return {"image": {"width": width, "height": height}, "detections": detections.to_json()}


def model_name(source) -> str:
    """The weights' name for answers: hf://ORG/NAME as given, else the file's name and its folder's (not
    the server's whole path)."""
    text = str(source or "model")
    path = Path(text)
    return text if text.startswith("hf://") or not path.parent.name else f"{path.parent.name}/{path.name}"
