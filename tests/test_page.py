"""The server's page (deformable_detr/serving/static/index.html) in a real headless Chromium driven by
Playwright: an uploaded val image's boxes are those of the server's JSON at the slider's threshold, the
slider changes them, a click on a box draws its sampling points (the page's state and the canvas's
pixels), the page shows what the server answered when it fails; names are data: a checkpoint whose class
names and model name hold HTML and script shows them literally and runs none of it, under the page's
Content-Security-Policy, and every answer carries X-Content-Type-Options: nosniff. Debian's chromium (.ci/run
installs it); Playwright's own browser download is not used."""

import base64
import contextlib
import hashlib
import html.parser
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from deformable_detr.inference.visualize import LEVEL_COLOURS
from deformable_detr.weights.files import CLASS_NAMES_KEY, class_names_metadata, open_safetensors, write_safetensors

import pytest
from test_evaluate import trained  # noqa: F401  (the fixture: a tiny model trained a few epochs)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
try:
    from playwright import sync_api as playwright
except ImportError:
    playwright = None
pytest.importorskip("starlette", reason="the serve extra (starlette, uvicorn) is not installed")
# Headless, and nothing reaching out of this machine (its connections are refused here)
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking"]
FLAGS += ["--disable-component-update", "--disable-sync"]
SCREENSHOT = os.environ.get("DEFORMABLE_DETR_PAGE_SCREENSHOT")  # where to keep the screenshot (docs/serve.png)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(trained):  # noqa: F811
    root, output = trained
    with serving(output / "checkpoint.safetensors") as url:
        yield url, root


@contextlib.contextmanager
def serving(checkpoint: Path):
    """`python -m deformable_detr.serve --checkpoint checkpoint` on a free loopback port: its URL once
    /healthz says it is ready; terminated after."""
    port = free_port()
    command = [sys.executable, "-m", "deformable_detr.serve", "--checkpoint", str(checkpoint)]
    process = subprocess.Popen([*command, "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=2) as answer:
                if answer.status == 200:
                    break
        except OSError:
            time.sleep(0.3)
    else:
        process.kill()
        pytest.fail(f"the server did not become healthy: {process.stdout.read().decode()[-2000:]}")
    try:
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)


def detections(url: str, image: Path, threshold: float) -> list:
    request = urllib.request.Request(
        f"{url}/v1/detect?threshold={threshold}&attention=1", data=image.read_bytes(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())["detections"]


@pytest.fixture()
def browser_page():
    if playwright is None:
        pytest.skip("playwright is not installed (the dev extra)")
    if CHROMIUM is None:
        pytest.skip("no chromium here (.ci/run installs Debian's package)")
    with playwright.sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1100, "height": 900})
        # What the page's Content-Security-Policy refused, recorded before any of the page's own script runs
        page.add_init_script(
            "window.__violations = []; document.addEventListener('securitypolicyviolation', (event) => "
            "window.__violations.push(`${event.effectiveDirective}: ${event.blockedURI} ${event.sample}`));"
        )
        yield page
        browser.close()


def state(page, expression: str):
    return page.evaluate(f"() => {expression}")


def test_boxes_slider_and_sampling_points(server, browser_page):
    url, root = server
    page = browser_page
    image = sorted((root / "val2017").iterdir())[0]
    page.goto(url)
    page.wait_for_function("() => window.page.model !== null")
    page.set_input_files("#file", str(image))
    page.wait_for_function("() => window.page.current && window.page.current.layer !== null")
    found = detections(url, image, 0.05)  # what the page asked for: every detection it can show
    assert state(page, "window.page.error") is None and len(found) > 2
    assert state(page, "window.page.current.detections") == found

    scores = sorted((d["score"] for d in found), reverse=True)
    high, low = round(scores[0] - 0.005, 2), round(scores[2] - 0.005, 2)  # thresholds that keep 1+ and 3+ boxes
    for threshold in (high, low):
        page.fill("#threshold", str(threshold))
        expected = [d for d in found if d["score"] >= threshold]
        drawn = state(page, "window.page.drawn")
        assert [d["query"] for d in drawn] == [d["query"] for d in expected]
        assert [d["query"] for d in drawn] == [d["query"] for d in detections(url, image, threshold)]
    assert len(state(page, "window.page.drawn")) > 1

    before = canvas_pixels(page)
    chosen = pick_and_click(page, found, low)
    model = state(page, "window.page.model")
    assert state(page, "window.page.selected.query") == chosen["query"]
    assert state(page, "window.page.pointsDrawn") == model["heads"] * model["levels"] * model["points"]
    assert_heaviest_dot_drawn(page, before)
    assert state(page, "window.__violations") == []  # all of it works under the page's policy
    if SCREENSHOT:
        page.screenshot(path=SCREENSHOT, full_page=True)


def canvas_pixels(page) -> list:
    return state(
        page,
        "Array.from(document.getElementById('canvas').getContext('2d').getImageData(0, 0, "
        "document.getElementById('canvas').width, document.getElementById('canvas').height).data)",
    )


def pick_and_click(page, found: list, threshold: float) -> dict:
    """Click the centre of the best detection's box; -> the detection the page's rule selects there (the
    smallest visible box around the click)."""
    best = max(found, key=lambda d: d["score"])
    x, y = (best["box"][0] + best["box"][2]) / 2, (best["box"][1] + best["box"][3]) / 2
    around = [
        d
        for d in found
        if d["score"] >= threshold and d["box"][0] <= x <= d["box"][2] and d["box"][1] <= y <= d["box"][3]
    ]
    chosen = min(around, key=lambda d: (d["box"][2] - d["box"][0]) * (d["box"][3] - d["box"][1]))
    bounds = page.locator("#canvas").bounding_box()
    scale = state(page, "window.page.scale") * bounds["width"] / state(page, "document.getElementById('canvas').width")
    page.mouse.click(bounds["x"] + x * scale, bounds["y"] + y * scale)
    return chosen


def assert_heaviest_dot_drawn(page, before: list):
    """The heaviest sampling point's centre: its level's colour at 0.8 over the faded picture."""
    width = state(page, "document.getElementById('canvas').width")
    dot = max(state(page, "window.page.points"), key=lambda p: p["weight"])
    level_rgb = LEVEL_COLOURS[dot["level"] % len(LEVEL_COLOURS)]  # served by /v1/model: the PNG view's colours
    x, y = int(dot["x"]), int(dot["y"])
    if not (0 <= x < width and 0 <= y < len(before) // 4 // width):
        pytest.skip("the heaviest point is outside the image")  # sampling may reach past the border
    after = canvas_pixels(page)
    at = 4 * (y * width + x)
    assert after[at : at + 3] != before[at : at + 3]
    # drawn last at alpha 0.8: 0.8 x its colour + 0.2 x whatever lay under it (0..255), channel by channel
    for got, level_channel in zip(after[at : at + 3], level_rgb, strict=True):
        assert 0.8 * level_channel - 2 <= got <= 0.8 * level_channel + 0.2 * 255 + 2, (after[at : at + 3], level_rgb)


def test_the_page_shows_what_the_server_answered(server, browser_page, tmp_path):
    url, _ = server
    page = browser_page
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_bytes(b"not an image at all")
    page.goto(url)
    page.wait_for_function("() => window.page.model !== null")
    page.set_input_files("#file", str(not_an_image))
    page.wait_for_function("() => window.page.error !== null")
    shown = page.inner_text("#error")
    assert "notes.png: the server answered 415" in shown and "not an image" in shown
    assert page.is_visible("#error")


# Names as hostile files carry them: each class name holds them all (so every row shows each), in
# attribute, element and text contexts; the model's name is its folder's and file's.
PAYLOADS = (
    '<img src=x onerror="window.__xss=1;alert(1)">',
    "<script>window.__xss=2</script>",
    '"><svg onload="window.__xss=3">',
    "' autofocus onfocus='window.__xss=4' x='",
    "Tom & Jerry &amp; &lt;b&gt; <!--",
)
MODEL_FOLDER = '"><svg onload="window.__xss=5">'
MODEL_FILE = "<img src=x onerror=alert(6)> & 'co'.safetensors"
IMAGE_FILE = '<img src=x onerror="window.__xss=7">.png'


@pytest.fixture(scope="module")
def payload_server(trained, tmp_path_factory):  # noqa: F811
    """The trained model served from a checkpoint whose class names and path hold `PAYLOADS`."""
    root, output = trained
    arrays, metadata = open_safetensors(output / "checkpoint.safetensors")
    hostile = {int(k): f"{k} {' '.join(PAYLOADS)}" for k in json.loads(metadata[CLASS_NAMES_KEY])}
    checkpoint = tmp_path_factory.mktemp("payload") / MODEL_FOLDER / MODEL_FILE
    write_safetensors(checkpoint, arrays, {**metadata, **class_names_metadata(hostile)})
    with serving(checkpoint) as url:
        yield url, root, hostile


def test_names_show_as_text_and_run_nothing(payload_server, browser_page, tmp_path):
    url, root, hostile = payload_server
    page = browser_page
    dialogs = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    image = tmp_path / IMAGE_FILE
    shutil.copy(sorted((root / "val2017").iterdir())[0], image)
    page.goto(url)
    page.wait_for_function("() => window.page.model !== null")
    model = state(page, "window.page.model")
    assert model["name"] == f"{MODEL_FOLDER}/{MODEL_FILE}"
    assert model["classes"] == {str(k): name for k, name in hostile.items()}
    assert page.text_content("#model").startswith(f"{MODEL_FOLDER}/{MODEL_FILE}: {len(hostile)} classes")

    page.set_input_files("#file", str(image))
    page.wait_for_function("() => window.page.current && window.page.current.layer !== null")
    page.fill("#threshold", "0.05")  # the slider's lowest: a row for every detection the page has
    found = [d for d in state(page, "window.page.current.detections") if d["score"] >= 0.05]
    assert state(page, "window.page.error") is None and found
    pick_and_click(page, found, 0.05)  # the table again, with a selected row; the sampling points
    assert state(page, "window.page.selected") is not None
    cells = state(page, "Array.from(document.querySelectorAll('#table tbody tr'), (row) => row.cells[1].textContent)")
    assert cells == [d["name"] for d in found] and set(cells) <= set(hostile.values())
    assert page.text_content("#status").startswith(f"{IMAGE_FILE}: ")
    assert state(page, "document.getElementById('images').selectedOptions[0].textContent") == IMAGE_FILE

    page.wait_for_load_state("networkidle")  # what an injected <img src=x> would have fetched, and failed
    assert state(page, "document.querySelectorAll('img, svg, iframe, object, embed, [onerror], [onload]').length") == 0
    assert state(page, "document.scripts.length") == 1
    assert state(page, "window.__xss") is None and dialogs == []
    assert state(page, "window.__violations") == []  # nothing even tried, so the policy had nothing to refuse


def test_the_policy_refuses_injected_script(server, browser_page):
    """Were a name ever parsed as HTML, the page's policy would still run none of it: an inline handler
    and an inline <script> put in by script are refused (and reported), the page's own script ran."""
    url, _ = server
    page = browser_page
    page.goto(url)
    page.wait_for_function("() => window.page.model !== null")
    page.evaluate(
        """() => {
        const probe = document.createElement("div");
        probe.innerHTML = '<img src="data:," onerror="window.__xss = 1">';
        const script = document.createElement("script");
        script.textContent = "window.__xss = 2";
        document.body.append(probe, script);
    }"""
    )
    page.wait_for_function("() => window.__violations.some((v) => v.startsWith('script-src-attr'))")
    assert state(page, "window.__xss") is None
    directives = {v.split(":")[0] for v in state(page, "window.__violations")}
    assert {"script-src-elem", "script-src-attr", "img-src"} <= directives


class InlineElements(html.parser.HTMLParser):
    """The text of each <script> and <style> element of a page, as an HTML parser reads it."""

    def __init__(self):
        super().__init__()
        self.found, self.open = {"script": [], "style": []}, None

    def handle_starttag(self, tag, attrs):
        if tag in self.found:
            self.open = tag
            self.found[tag].append("")

    def handle_endtag(self, tag):
        self.open = None

    def handle_data(self, data):
        if self.open:
            self.found[self.open][-1] += data


def test_every_answer_says_nosniff_and_the_page_its_policy(server):
    url, _ = server
    host, port = url.removeprefix("http://").split(":")
    asked = [  # (method, path, body, headers, the status expected): the page, the API, each kind of error
        ("GET", "/", None, {}, 200),
        ("GET", "/healthz", None, {}, 200),
        ("GET", "/v1/model", None, {}, 200),
        ("GET", "/v1/stats", None, {}, 200),
        ("GET", "/nothing-here", None, {}, 404),
        ("GET", "/v1/detect", None, {}, 405),
        ("POST", "/v1/detect", b"", {}, 400),
        ("POST", "/v1/detect", b"<script>alert(1)</script>", {"Content-Type": "text/html"}, 415),
        ("POST", "/v1/detect", b"", {"Content-Length": str(10**9)}, 413),
    ]
    for method, path, body, headers, status in asked:
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        connection.request(method, path, body, headers)
        answer = connection.getresponse()
        answer.read()
        connection.close()
        assert (answer.status, answer.getheader("X-Content-Type-Options")) == (status, "nosniff"), (method, path)
    with urllib.request.urlopen(url, timeout=60) as answer:
        policy, page = answer.headers["Content-Security-Policy"], answer.read().decode()
    directives = dict(directive.strip().split(" ", 1) for directive in policy.split(";"))
    elements = InlineElements()
    elements.feed(page)
    for tag in ("script", "style"):
        [text] = elements.found[tag]  # the page has one of each
        digest = base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()
        assert directives[f"{tag}-src"] == f"'sha256-{digest}'"
    assert directives["default-src"] == directives["base-uri"] == directives["frame-ancestors"] == "'none'"
    assert directives["connect-src"] == "'self'" and "unsafe" not in policy


def test_a_server_error_says_nosniff_too(trained):  # noqa: F811
    """A 500 is answered by Starlette's ServerErrorMiddleware, outside the middleware it registers: a route
    that raises stands in for a bug (no client's request reaches one)."""
    from deformable_detr import Detector
    from deformable_detr.serving.app import create_app

    from starlette.routing import Route
    from starlette.testclient import TestClient

    def broken(request):
        raise RuntimeError("a bug")

    _, output = trained
    app = create_app(Detector.load(output / "checkpoint.safetensors"))
    app.router.routes.append(Route("/broken", broken))
    answer = TestClient(app, raise_server_exceptions=False).get("/broken")
    assert (answer.status_code, answer.headers.get("X-Content-Type-Options")) == (500, "nosniff")
    assert answer.json() == {"error": "RuntimeError: a bug"}
