"""The README's screenshot of the chat UI: serves a model, asks it something in a real browser, saves a PNG.

Needs ``/usr/bin/chromium`` and the ``playwright`` package (the test extra has it; no browser is downloaded).

Usage: ``python -m bench.serving.ui_screenshot [--model smollm2-135m-instruct] [--out docs/images/chat-ui.png]``
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.common.results import ROOT
from bench.common.servers import free_port

CHROMIUM = "/usr/bin/chromium"
QUESTION = "Name three sights in Paris, one line each."


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"the server at {url} was not ready after {timeout:.0f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "chat-ui.png")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "lightinfer.cli", "serve", args.model, "--port", str(port)])
    try:
        _wait_ready(url, proc)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
            page.goto(url + "/")
            box = page.get_by_placeholder("Type a message...")
            box.wait_for(timeout=60_000)
            box.fill(QUESTION)
            box.press("Enter")
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:  # the reply is done when its stats line shows
                if any("tokens/s" in t for t in page.get_by_test_id("bot").all_inner_texts()):
                    break
                time.sleep(0.5)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(args.out))
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
