"""A real browser opens the dashboard: headless Chromium screenshots the Plan page (kept under
bench/results/), which must not be blank and must show the memory chart. `.ci/run` installs Chromium."""
from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import REPO

SCREENSHOT = REPO / "bench" / "results" / "dashboard_plan.png"
WEIGHTS_BLUE = (0x4C, 0x78, 0xA8)         # planner.plots.MEMORY_COLORS["weights"]


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.fail("no Chromium: `.ci/run` installs Debian's chromium (apt-get install chromium)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_headless_browser_screenshot_of_the_plan_page():
    from PIL import Image

    browser = chromium()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "streamlit", "run", str(REPO / "app.py"), "--server.headless",
                               "true", "--server.port", str(port), "--browser.gatherUsageStats", "false"],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 90
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2)
                break
            except OSError:
                assert time.time() < deadline, "the dashboard did not start within 90 s"
                time.sleep(1)
        SCREENSHOT.parent.mkdir(exist_ok=True)
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--window-size=1400,1100", "--virtual-time-budget=30000",
                        f"--screenshot={SCREENSHOT}", f"http://127.0.0.1:{port}/"],
                       check=True, capture_output=True, timeout=180)
    finally:
        server.terminate()
        server.wait(timeout=30)
    image = Image.open(SCREENSHOT).convert("RGB")
    colors = image.getcolors(maxcolors=1 << 20)
    assert len(colors) > 50, "the screenshot is blank"
    blue = sum(count for count, rgb in colors if all(abs(c - w) <= 12 for c, w in zip(rgb, WEIGHTS_BLUE)))
    assert blue > 2000, f"the memory chart's weights bar is not on the page ({blue} pixels)"
