"""End to end in a real headless browser (Debian's chromium driven by Playwright).

Types a prompt, picks a resolution, clicks Generate, sees the image and the cache line, and
watches the dropdown label turn `ready`; then asks for two images and sees both in the gallery.
Saves the screenshot the README shows.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOT = ROOT / "docs" / "screenshot.png"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 120_000

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def page(launched_app: Any) -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"chromium not found at {CHROMIUM}: .ci/run installs Debian's chromium package")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(launched_app.url)
        yield page
        browser.close()


def choose_resolution(page: Any, shape: str) -> None:
    dropdown = page.locator("#resolution input")
    dropdown.click()
    page.locator("ul[role='listbox'] li", has_text=shape).first.click()


def generate(page: Any, prompt: str, shape: str, expect: str, *, press_enter: bool = False, images: int = 1) -> str:
    choose_resolution(page, shape)
    count = page.locator("#images input[type='number']")
    count.fill(str(images))
    count.press("Tab")
    page.locator("#randomize input").uncheck()
    box = page.locator("#prompt textarea")
    box.fill(prompt)
    if press_enter:
        box.press("Enter")  # Enter submits the prompt
    else:
        page.locator("#generate").click()
    info = page.locator("#info")
    info.filter(has_text=f"{shape},").filter(has_text=expect).wait_for()
    return info.inner_text()


def test_type_pick_generate_see_image_and_ready_label(page: Any) -> None:
    label_input = page.locator("#resolution input")
    assert "64x64 - compiles on first use" in label_input.input_value()

    first = generate(page, "a lighthouse at dawn", "128x64", expect="cache: miss")
    assert "compiled 1 graph" in first
    image = page.locator("#gallery img")
    image.first.wait_for()
    assert image.count() == 1 and image.first.get_attribute("src")
    page.wait_for_function(
        "() => document.querySelector('#resolution input').value.includes('128x64 - ready')", timeout=TIMEOUT_MS
    )

    # Two images at once: consecutive seeds, both from the graph compiled above, shown in the gallery.
    page.locator("#seed input").fill("7")
    second = generate(page, "a lighthouse at dusk", "128x64", expect="seed 8", press_enter=True, images=2)
    assert "compiled" not in second and second.count("cache: memory") == 2 and "seed 7" in second
    page.wait_for_function("() => document.querySelectorAll('#gallery img').length >= 2", timeout=TIMEOUT_MS)
    # The status table (refreshed by the timer) shows the shape ready with two hits.
    page.locator("#shapes").filter(has_text="ready").wait_for()
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOT), full_page=True)
    assert SCREENSHOT.stat().st_size > 10_000


def test_upload_a_reference_edit_and_use_the_result_as_the_next_reference(page: Any, tmp_path: Path) -> None:
    """Upload a wide reference, pick `auto` (offered only while references are uploaded), edit, then put the
    result back as a second reference."""
    from PIL import Image

    wide = tmp_path / "wide.png"
    Image.new("RGB", (240, 120), (30, 90, 200)).save(wide)
    page.locator("#references input[type=file]").set_input_files(str(wide))
    page.wait_for_function("() => document.querySelector('#resolution input').value !== ''", timeout=TIMEOUT_MS)
    choose_resolution(page, "auto - ")
    page.locator("#randomize input").uncheck()
    page.locator("#prompt textarea").fill("make the sky orange")
    page.locator("#generate").click()
    info = page.locator("#info").filter(has_text="references 240x120 → 128x64")
    info.wait_for()
    assert "128x64, " in info.inner_text()  # auto: the served shape nearest the reference's 2:1
    page.locator("#use-as-reference").click()
    page.wait_for_function("() => document.querySelectorAll('#references img').length >= 2", timeout=TIMEOUT_MS)
