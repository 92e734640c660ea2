"""The detection server's Starlette app: `create_app(detector, ...)`.

    POST /v1/detect  an image as the body, or several as multipart/form-data (each file part an image);
                     query threshold (0.5), attention (0/1/false/true), attention_layer (-1), slice (W,H:
                     detections from W x H slices of each image, inference/slicing.py), overlap (0.2, of a slice)
                     -> {"model", "image": {"width", "height"}, "detections": [Detections.to_json()]}
                        or {"model", "results": [{"filename", "image", "detections"}, ...]};
                        header X-Batch-Size: the forward batch the (first) image ran in
    GET /v1/model    the model: name, architecture (deformable_detr, dino), classes, queries, layers, heads,
                     levels, points, top_k (the most detections an image: evaluation.top_k, DINO's 300),
                     val_size, max_size, level_colours ([r, g, b] of each feature level's sampling points,
                     inference/visualize.py's)
    GET /v1/stats    requests, images, batches, batch_sizes {size: count}, queued, megapixels (of the pixel
                     budget held now, as uploads.decoding_cost counts them), errors (answers 4xx or 5xx),
                     disconnects (clients gone before their answer), timeouts (stalled: headers or a body
                     not in within the read timeout, closed)
    GET /healthz     200 {"status": "ok"} once the model has run a warm-up forward, else 503
    GET /            static/index.html (the page), where it is there

Every error is a one-line JSON {"error": "..."} with its status, quoting at most 40 characters of what a
client sent: 400 a bad query value or an empty body, 405 another method (with Allow), 408 a body stalled
over read_timeout between two chunks (the connection closed), 413 a body over max_body_mb, an image over
Pillow's pixel limit or images over the whole pixel budget, 415 not an image, 422 an image whose data is
truncated or corrupt, 503 a full queue or a pixel budget taken by other requests (both with Retry-After),
or a server shutting down; 501 slice where supervision (the `slice` extra) is not installed. Query values
are ASCII: threshold a decimal in [0, 1] ("0.3", ".3", "1"; no sign, exponent, nan), attention_layer an
integer (-1 the last layer), slice two integers of at least 1 ("256,256"), overlap a decimal in [0, 1) and
only with slice, and not slice with attention; each key once. The pixel budget
(max_megapixels) counts the images held decoded at once, decoding, queued and in a forward: a request's
images are counted from their headers before any is decoded and given back once it is answered. A
multipart request is answered whole or not at all: one bad part fails it with that part's status, the
message naming the part (its number and filename). Every answer carries X-Content-Type-Options: nosniff
(`NoSniff`); the page, a Content-Security-Policy that runs its own inline script and style alone
(`page_policy`): names are data, in the page as in the JSON."""

import asyncio
import base64
import contextlib
import hashlib
import re
from pathlib import Path

import mlx.core as mx
from PIL import Image
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse
from starlette.routing import Route

from ..errors import DECIMAL, CommandError, quoted
from ..inference.slicing import parse_slice, slice_count
from ..inference.visualize import LEVEL_COLOURS
from ..weights.hub import is_hub
from .batcher import Batcher, Closed, QueueFull
from .uploads import ClientError, OverBudget, PixelBudget, decode, decoding_cost, read_header

PAGE = Path(__file__).parent / "static" / "index.html"
RETRY_AFTER_S = 1  # what a 503 for a full queue or a taken pixel budget asks the client to wait
LAYER = re.compile(r"-?[0-9]{1,6}")
DIGITS = re.compile(r"[0-9]+")
TRUE, FALSE = ("1", "true"), ("0", "false")
QUERY_KEYS = ("threshold", "attention", "attention_layer", "slice", "overlap")
SLICED = "slice"  # the first item of a sliced image's batch key: it runs alone, with its slices as the batches


def create_app(
    detector,
    max_batch: int = 8,
    max_wait_ms: float = 10,
    max_queue: int = 64,
    max_body_mb: float = 20,
    name=None,
    max_megapixels: float = 128,
    read_timeout: float = 10,
    max_slices: int = 1024,
) -> Starlette:
    """The app serving `detector` (`Detector`); `name`: the model's name in answers (default: its
    weights' file or hf:// name); `read_timeout`: seconds a body may stall between two chunks (408);
    `max_slices`: the slices a request's images may ask for together (`slice`; 400 beyond). The
    batcher's worker starts (and warms up) with the app's lifespan and, at shutdown, runs what is queued
    before it stops."""
    service = DetectionService(
        detector, max_batch, max_wait_ms / 1000, max_queue, max_body_mb, name, max_megapixels, read_timeout, max_slices
    )

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
    # Around Starlette's whole stack: its registered middleware sits inside ServerErrorMiddleware, whose 500s
    # would go out without the header.
    app.middleware_stack = NoSniff(app.build_middleware_stack())
    app.state.service = service
    return app


class NoSniff:
    """ASGI middleware: `X-Content-Type-Options: nosniff` on every answer, so that no browser takes an answer
    (JSON quoting class names or what a client sent) for HTML or script."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        async def send_nosniff(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"x-content-type-options", b"nosniff")]
            await send(message)

        await self.app(scope, receive, send_nosniff if scope["type"] == "http" else send)


INLINE_ELEMENT = re.compile(r"<(script|style)\b[^>]*>(.*?)</\1\s*>", re.DOTALL | re.IGNORECASE)


def page_policy(html: str) -> str:
    """The page's Content-Security-Policy: its own inline <script> and <style> elements run and apply, by
    their SHA-256 (of the text the browser hashes: line ends as its HTML parser makes them), fetch() to this
    server; nothing else: no other or injected script, no inline handler or style attribute, no plugin,
    image, frame, <base> or form target, and no page may frame it."""
    hashes = {"script": [], "style": []}
    for tag, text in INLINE_ELEMENT.findall(html):
        digest = hashlib.sha256(text.replace("\r\n", "\n").replace("\r", "\n").encode()).digest()
        hashes[tag.lower()].append(f"'sha256-{base64.b64encode(digest).decode()}'")
    sources = {tag: " ".join(found) or "'none'" for tag, found in hashes.items()}
    return (
        f"default-src 'none'; script-src {sources['script']}; style-src {sources['style']}; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )


def error(status: int, message: str, headers=None) -> JSONResponse:
    return JSONResponse({"error": " ".join(str(message).splitlines())}, status, headers)


async def http_error(request, exc: HTTPException) -> JSONResponse:
    """404, 405 (with Starlette's Allow header) and the like, naming the method and path asked; a request
    that carries a body is answered with the connection closed (`UNREAD_BODY`)."""
    headers = {**(exc.headers or {}), **(UNREAD_BODY if carries_body(request) else {})}
    return error(exc.status_code, f"{request.method} {quoted(request.url.path)}: {exc.detail}", headers)


# An answer given before the request's body is all read closes the connection: the body left to come would
# hold it open (each byte restarts uvicorn's keep-alive timer, and no read timeout is running then).
UNREAD_BODY = {"Connection": "close"}


def carries_body(request) -> bool:
    return request.headers.get("content-length", "0") != "0" or "transfer-encoding" in request.headers


async def server_error(request, exc: Exception) -> JSONResponse:
    return error(500, f"{type(exc).__name__}: {exc}")


class DetectionService:
    """The routes' handlers over one `Detector` and its `Batcher`, with the counts /v1/stats reports."""

    def __init__(
        self, detector, max_batch, max_wait, max_queue, max_body_mb, name, max_megapixels, read_timeout, max_slices=1024
    ):
        self.detector, self.max_body = detector, int(max_body_mb * 1024 * 1024)
        # Loaded weights may still be lazy on the loading thread's MLX stream, which the worker cannot use:
        # computed here, on that thread (MLX streams belong to the thread that made them).
        mx.eval(detector.model.parameters())
        self.name = name or model_name(detector.source)
        self.batcher = Batcher(self.run, max_batch, max_wait, max_queue)
        self.budget, self.read_timeout = PixelBudget(int(max_megapixels * 1e6)), read_timeout
        self.requests = self.images = self.errors = self.disconnects = self.timeouts = 0
        self.max_slices = max_slices

    def count_timeout(self) -> None:
        """A connection closed for stalling (the body's here, the headers' in serving/connections.py)."""
        self.timeouts += 1

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
        detections are those `predict` keeps at that threshold (the same ones, best first). A sliced image's key
        (SLICED, size, overlap, threshold) runs it with its threshold (the merge takes the kept detections), its
        slices max_batch a forward."""
        if key[0] == SLICED:  # checked once, by slice_options: predict_batches takes them as they are
            _, size, overlap, threshold = key
            batches = self.detector.predict_batches(  # images, not files: nothing unreadable (None)
                images, None, threshold, self.batcher.max_batch, sliced=(size, overlap)
            )
            return [detections for batch in batches for _, _, detections in batch]
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
        except ClientDisconnect:
            response = None
        except ClientError as failure:
            response = error(failure.status, failure, None if request.state.body_read else UNREAD_BODY)
        except (QueueFull, OverBudget) as full:
            response = error(503, full, {"Retry-After": str(RETRY_AFTER_S)})
        except Closed as closed:
            response = error(503, closed)
        except Exception as failure:  # noqa: BLE001  (the model failed on this batch: 500; the server goes on)
            response = await server_error(request, failure)
        self.budget.return_memory()  # the request's decoded images are unreferenced by now
        # is_disconnected() reads from the client: only once the body is in (before, it would take a chunk of
        # it, and answer 100 Continue to a client that asked before sending a body this answer refuses)
        if response is None or (request.state.body_read and await request.is_disconnected()):
            self.disconnects += 1  # nobody to answer: not the server's error nor the request's
            return response or error(400, "the client disconnected before its answer")
        if response.status_code == 408:
            self.timeouts += 1
        elif response.status_code >= 400:
            self.errors += 1
        return response

    async def _detect(self, request: Request) -> JSONResponse:
        request.state.body_read = False
        threshold, layer = detect_options(request.query_params, self.detector.cfg.model.dec_layers)
        sliced = slice_options(request.query_params, layer)
        body = await read_body(request, self.max_body, self.read_timeout)
        request.state.body_read = True
        content_type = request.headers.get("content-type", "")
        uploads = await form_files(request, body) if content_type.startswith("multipart/form-data") else None
        named = uploads if uploads is not None else [("the body", body)]
        if len(named) > self.batcher.max_queue:
            raise ClientError(
                413, f"{len(named)} images in one request: at most {self.batcher.max_queue} (--max-queue)"
            )
        if uploads is not None:  # messages name the part: its number and (a short prefix of) its filename
            named = [(f"part {i} ({quoted(filename)})", data) for i, (filename, data) in enumerate(named, 1)]
        headers = [await run_in_threadpool(read_header, data, name) for name, data in named]
        if sliced is not None:
            self.check_slices(headers, *sliced)
        with self.budget.reserved(sum(decoding_cost(header) for header in headers)):
            return await self._answer(uploads, headers, threshold, layer, sliced)

    def check_slices(self, headers: list, size: tuple[int, int], overlap: float) -> None:
        """400 where the images of `headers` ask for more than max_slices slices together, counted from
        their headers (the frame they are decoded in), before any is decoded: a forward a slice, a small
        slice or a large overlap on a large image would hold the worker for minutes."""
        counts = [slice_count(header.size_in("displayed"), size, overlap) for header in headers]
        if sum(counts) > self.max_slices:
            largest = max(range(len(counts)), key=counts.__getitem__)
            width, height = headers[largest].size_in("displayed")
            raise ClientError(
                400,
                f"slice {size[0]},{size[1]} overlap {overlap:g}: {sum(counts):,} slices ({counts[largest]:,} of "
                f"{headers[largest].path}, {width} x {height}); at most {self.max_slices:,} a request "
                "(--max-slices): larger slices, less overlap or a smaller image",
            )

    async def _answer(self, uploads, headers: list, threshold: float, layer, sliced=None) -> JSONResponse:
        """The answer to a request whose images' pixels are reserved: decoded, run, kept at `threshold`;
        `sliced` (size, overlap): each image on its slices."""
        images = []
        for header in headers:
            images.append(await run_in_threadpool(decode, header))
        keys = [(self.detector.batch_key(image), layer) for image in images]
        if sliced is not None:
            keys = [(SLICED, *sliced, threshold)] * len(images)
        futures = self.batcher.submit(list(zip(images, keys, strict=True)))
        del images  # the worker's now, freed once run: before the answer, so that return_memory finds them gone
        answers = await asyncio.gather(*(asyncio.wrap_future(future) for future in futures))
        self.images += len(futures)
        found = [(detections.at_threshold(threshold), size) for detections, size in answers]
        batch = {"X-Batch-Size": str(found[0][1])}
        if uploads is None:
            return JSONResponse({"model": self.name, **one_result(found[0][0])}, headers=batch)
        results = [{"filename": name, **one_result(d)} for (name, _), (d, _) in zip(uploads, found, strict=True)]
        return JSONResponse({"model": self.name, "results": results}, headers=batch)

    async def model(self, request: Request) -> JSONResponse:
        model, data = self.detector.cfg.model, self.detector.cfg.data
        return JSONResponse(
            {
                "name": self.name,
                "architecture": model.architecture,
                "classes": {str(k): v for k, v in sorted(self.detector.class_names.items())},
                "num_queries": model.num_queries,
                "decoder_layers": model.dec_layers,
                "encoder_layers": model.enc_layers,
                "heads": model.nheads,
                "levels": model.num_feature_levels,
                "points": model.dec_n_points,
                "top_k": self.detector.cfg.evaluation.top_k,
                "val_size": data.val_size,
                "max_size": data.max_size,
                "level_colours": [list(colour) for colour in LEVEL_COLOURS],
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
                "megapixels": self.budget.megapixels,
                "errors": self.errors,
                "disconnects": self.disconnects,
                "timeouts": self.timeouts,
            }
        )

    async def health(self, request: Request) -> JSONResponse:
        if self.batcher.ready.is_set():
            return JSONResponse({"status": "ok"})
        return error(503, "the model is not ready: loading or warming up")

    async def page(self, request: Request):
        if PAGE.is_file():
            html = PAGE.read_text(encoding="utf-8")  # at each request: the policy's hashes are those of what is sent
            return HTMLResponse(html, headers={"Content-Security-Policy": page_policy(html)})
        return error(404, "no page: deformable_detr/serving/static/index.html is not there (the API is under /v1/)")


def detect_options(query, decoder_layers: int) -> tuple[float, int | None]:
    """-> (threshold, the decoder layer whose sampling points are asked, 0 to layers - 1, or None), read
    strictly: ASCII forms alone, each key once (the module's docstring)."""
    unknown = sorted(set(query) - set(QUERY_KEYS))
    if unknown:
        raise ClientError(400, f"unknown query parameter {quoted(unknown[0])}: expected {', '.join(QUERY_KEYS)}")
    repeated = [key for key in QUERY_KEYS if len(query.getlist(key)) > 1]
    if repeated:
        raise ClientError(400, f"query parameter {repeated[0]} given more than once: give it once")
    threshold = query.get("threshold", "0.5")
    if not DECIMAL.fullmatch(threshold) or not 0 <= float(threshold) <= 1:
        raise ClientError(400, f"threshold {quoted(threshold)}: expected a decimal from 0 to 1, such as 0.3")
    attention = query.get("attention", "0")
    if attention.lower() not in TRUE + FALSE or not attention.isascii():
        raise ClientError(400, f"attention {quoted(attention)}: expected 1, true, 0 or false")
    layer = query.get("attention_layer", "-1")
    if not LAYER.fullmatch(layer) or not -decoder_layers <= int(layer) < decoder_layers:
        layers = f"{decoder_layers} decoder layers (0 to {decoder_layers - 1}, or -1: the last)"
        raise ClientError(400, f"attention_layer {quoted(layer)}: the model has {layers}")
    return float(threshold), int(layer) % decoder_layers if attention.lower() in TRUE else None


def slice_options(query, layer) -> tuple | None:
    """-> ((width, height), overlap) of the slices asked, or None (slicing.parse_slice, the command's
    parser): 400 naming slice or overlap where either is malformed, overlap without slice, or slice with
    attention (`layer`); 501 where supervision is missing."""
    try:
        sliced = parse_slice(query.get("slice"), query.get("overlap"))
    except CommandError as failure:  # UsageError (400): what the client sent; else a missing extra (501)
        raise ClientError(400 if failure.status == 2 else 501, str(failure)) from None
    if sliced is not None and layer is not None:
        raise ClientError(400, "slice: attention shows one forward of a whole image; not with slice")
    return sliced


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, refused (413) before it is read where Content-Length is over `limit` bytes, else as soon
    as what has come passes it; 408 where the client sends nothing for `timeout` seconds before it is all
    in (a client that stalls holds no connection for longer). ClientDisconnect where the client leaves."""
    declared = request.headers.get("content-length", "")
    too_big = f"the body is over the server's limit of {limit / 1024 / 1024:g} MB (--max-body-mb)"
    if DIGITS.fullmatch(declared) and int(declared) > limit:
        raise ClientError(413, too_big)
    chunks, size = [], 0
    stream = aiter(request.stream())
    while True:
        try:
            chunk = await asyncio.wait_for(anext(stream), timeout)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:  # TimeoutError from Python 3.11 on
            raise ClientError(408, f"the body stalled: nothing came for {timeout:g} s (--read-timeout-s)") from None
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
    return text if is_hub(text) or not path.parent.name else f"{path.parent.name}/{path.name}"
