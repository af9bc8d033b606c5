"""The README's screenshot, made from the real page: the quick start (`NEURON_APP_SETTINGS=quickstart.toml python
app.py`) in a fresh cache folder on a free port, three prompts of tiny-shapes' world generated through the page in
Debian's chromium (Playwright drives it), then a full-page screenshot.

    python scripts/screenshot.py                      # writes docs/screenshot.png (a few minutes on 2 cores)
    python scripts/screenshot.py --out /tmp/page.png
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from neuron_app.bench.common import free_port  # noqa: E402

PROMPTS = (
    "a large green triangle on a white background",
    "a small yellow circle on a black background at the top",
    "a red square on a blue background on the left",
)
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 1800) -> None:
    """Until /readyz says 200: the model loaded and 128x128 warmed up (the quick start's warmup = default)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"app.py exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url + "readyz", timeout=5).close()
            return
        except (urllib.error.HTTPError, OSError):
            time.sleep(1)
    raise SystemExit("the app did not become ready")


def shoot(url: str, out: Path) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(600_000)
            page.goto(url)
            for prompt in PROMPTS:
                page.locator("#prompt textarea").fill(prompt)
                page.locator("#generate").click()
                page.locator("#history img").nth(PROMPTS.index(prompt)).wait_for()  # this one in the history
            page.locator("#info").filter(has_text="128x128, ").wait_for()
            page.wait_for_timeout(2500)  # the status panel's next refresh (every 2 s)
            page.screenshot(path=str(out), full_page=True)
        finally:
            browser.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshot.png", help="where the PNG goes")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="screenshot-") as folder:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_APP_")}
        env |= {"NEURON_APP_SETTINGS": "quickstart.toml", "NEURON_APP_CACHE_DIR": str(Path(folder) / "cache")}
        env |= {"NEURON_APP_SERVER_PORT": str(port)}
        with (Path(folder) / "app.log").open("wb") as log:
            proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                url = f"http://127.0.0.1:{port}/"
                wait_ready(url, proc)
                shoot(url, args.out)
            finally:
                proc.terminate()
                proc.wait(timeout=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
