"""The server's page (deformable_detr/serving/static/index.html) in a real headless Chromium driven by
Playwright: an uploaded val image's boxes are those of the server's JSON at the slider's threshold, the
slider changes them, a click on a box draws its sampling points (the page's state and the canvas's
pixels), the page shows what the server answered when it fails. Debian's chromium (.ci/run installs it);
Playwright's own browser download is not used."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from test_evaluate import trained  # noqa: F401  (the fixture: a tiny model trained a few epochs)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the dev extra)")
pytest.importorskip("starlette", reason="the serve extra (starlette, uvicorn) is not installed")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (.ci/run installs Debian's package)")
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
    port = free_port()
    command = [sys.executable, "-m", "deformable_detr.serve", "--checkpoint", str(output / "checkpoint.safetensors")]
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
    yield url, root
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
    with playwright.sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1100, "height": 900})
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
    colour = state(page, f"LEVEL_COLOURS[{dot['level']} % 6]")
    level_rgb = [int(v) for v in colour[4:-1].split(",")]
    x, y = int(dot["x"]), int(dot["y"])
    if not (0 <= x < width and 0 <= y < len(before) // 4 // width):
        pytest.skip("the heaviest point is outside the image")  # sampling may reach past the border
    after = canvas_pixels(page)
    at = 4 * (y * width + x)
    assert after[at : at + 3] != before[at : at + 3]
    # drawn last at alpha 0.8: 0.8 x its colour + 0.2 x whatever lay under it (0..255), channel by channel
    for got, level_channel in zip(after[at : at + 3], level_rgb, strict=True):
        assert 0.8 * level_channel - 2 <= got <= 0.8 * level_channel + 0.2 * 255 + 2, (after[at : at + 3], colour)


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
