"""A real browser opens the dashboard: headless Chromium, driven over the DevTools protocol, waits for the
Plan page's chart and screenshots it into the test's own folder (bench/results/dashboard_plan.png, the docs'
picture, is one taken so: a test run rewrote the committed file every time); the image must not be blank and must
show the memory chart. `make test` installs Debian's chromium."""
from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import REPO

from engine.parallel.group import free_port

WEIGHTS_BLUE = (0x4C, 0x78, 0xA8)         # planner.ui.plots.MEMORY_COLORS["weights"]
CHART_SCRIPT = "document.querySelectorAll('.js-plotly-plot .bars path').length"


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.fail("no Chromium: `make test` installs Debian's chromium (apt-get install chromium)")


def wait_for(url: str, seconds: float) -> bytes:
    deadline = time.time() + seconds
    while True:
        try:
            return urllib.request.urlopen(url, timeout=2).read()
        except OSError:
            assert time.time() < deadline, f"{url} did not answer within {seconds} s"
            time.sleep(0.5)


def screenshot_when_charted(debug_port: int, page_url: str, seconds: float) -> tuple[bytes, int]:
    """Navigates, waits until the chart's bars exist, returns (PNG bytes, number of bars)."""
    import asyncio

    from websockets.asyncio.client import connect

    target = next(t for t in json.loads(wait_for(f"http://127.0.0.1:{debug_port}/json", 30)) if t["type"] == "page")

    async def drive() -> tuple[bytes, int]:
        async with connect(target["webSocketDebuggerUrl"], max_size=1 << 28) as connection:
            counter = 0

            async def call(method: str, **params):
                nonlocal counter
                counter += 1
                await connection.send(json.dumps({"id": counter, "method": method, "params": params}))
                while True:
                    message = json.loads(await connection.recv())
                    if message.get("id") == counter:
                        return message.get("result", {})

            await call("Page.navigate", url=page_url)
            deadline, bars = time.time() + seconds, 0
            while time.time() < deadline:
                result = await call("Runtime.evaluate", expression=CHART_SCRIPT, returnByValue=True)
                bars = result.get("result", {}).get("value") or 0
                if bars:
                    break
                await asyncio.sleep(0.5)
            await asyncio.sleep(2)                       # let the chart finish drawing
            shot = await call("Page.captureScreenshot", format="png")
            return base64.b64decode(shot["data"]), bars

    return asyncio.run(asyncio.wait_for(drive(), seconds + 60))


def test_headless_browser_screenshot_of_the_plan_page(tmp_path):
    from PIL import Image

    port, debug_port = free_port(), free_port()
    server = subprocess.Popen([sys.executable, "-m", "streamlit", "run", str(REPO / "app.py"), "--server.headless",
                               "true", "--server.port", str(port), "--browser.gatherUsageStats", "false"],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    browser = None
    try:
        wait_for(f"http://127.0.0.1:{port}/_stcore/health", 90)
        browser = subprocess.Popen([chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                                    f"--remote-debugging-port={debug_port}", "--window-size=1400,1100",
                                    "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        png, bars = screenshot_when_charted(debug_port, f"http://127.0.0.1:{port}/", 120)
    finally:
        for process in (browser, server):
            if process is not None:
                process.terminate()
                process.wait(timeout=30)
    screenshot = tmp_path / "dashboard_plan.png"
    screenshot.write_bytes(png)
    assert bars > 0, "the memory chart never appeared"
    image = Image.open(screenshot).convert("RGB")
    colors = image.getcolors(maxcolors=1 << 20)
    assert len(colors) > 50, "the screenshot is blank"
    blue = sum(count for count, rgb in colors if all(abs(c - w) <= 12 for c, w in zip(rgb, WEIGHTS_BLUE)))
    assert blue > 2000, f"the memory chart's weights bar is not on the page ({blue} pixels)"
