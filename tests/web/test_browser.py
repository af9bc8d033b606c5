"""End to end in a real headless browser (Debian's chromium driven by Playwright).

Types a prompt, picks a resolution, clicks Generate, reads in the output area what the first use compiles
and for how long, sees the image and the cache line, and watches the dropdown label turn `ready`; then asks
for two images and sees both in the gallery. Checks that the dropdown and the status table say the same
before and after a restart.

The screenshots go to pytest's temporary folder, never into the checkout; to refresh the one the docs show:
`SCREENSHOT_TO=docs/screenshot.png python -m pytest tests/web/test_browser.py` copies it there on purpose.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT, TINY_OVERRIDES, free_port, link_models, steps_held

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
#: Where a run copies its full-page screenshot when asked to (relative to the checkout), e.g. docs/screenshot.png.
SCREENSHOT_TO = os.environ.get("SCREENSHOT_TO")
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
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        # A system package, as node and npm are for test_node.py: a fail with the command, not a skip that would let
        # the README's "whole suite" pass with the page unchecked.
        pytest.fail(f"chromium not found at {CHROMIUM}: apt-get install chromium (see README, Tests)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def open_page(browser: Any, url: str) -> Any:
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(url)
    return page


@pytest.fixture
def page(launched_app: Any, browser: Any) -> Iterator[Any]:
    """A new visitor's tab on the module's app, one per test: no references uploaded, no history, the default shape
    chosen, whatever the tests before it did (a random order put an upload first, stop 59)."""
    page = open_page(browser, launched_app.url)
    yield page
    page.close()


def screenshot(page: Any, path: Path, publish: bool = True) -> None:
    """A full-page screenshot at `path` (a temporary folder); copied into the checkout only with SCREENSHOT_TO (and
    `publish`: the docs show the page with its images, not a shot mid-generation)."""
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000
    if SCREENSHOT_TO and publish:
        shutil.copyfile(path, ROOT / SCREENSHOT_TO)


def choose_resolution(page: Any, shape: str) -> None:
    dropdown = page.locator("#resolution input")
    dropdown.click()
    page.locator("ul[role='listbox'] li", has_text=shape).first.click()


def generate(
    page: Any,
    prompt: str,
    shape: str,
    expect: str,
    *,
    press_enter: bool = False,
    images: int = 1,
    during: Callable[[Any], None] | None = None,
) -> str:
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
    if during is not None:
        during(page)
    info = page.locator("#info")
    info.filter(has_text=f"{shape},").filter(has_text=expect).wait_for()
    return info.inner_text()


def test_type_pick_generate_see_image_and_ready_label(page: Any, tmp_path: Path) -> None:
    assert page.locator("#resolution input").input_value().startswith("64x64 - ")  # the default shape
    # Plain 128x64 (no references) is this test's own: no other test on this app compiles it.
    assert table_rows(page)["128x64"][1].startswith("not compiled")
    seen: dict[str, str] = {}

    def mid_compile(page: Any) -> None:
        """While the first use compiles, the output area (not only the spinner) says so, with the estimate."""
        compiling = page.locator("#info").filter(has_text="128x64 - compiling (first use)")
        compiling.wait_for()
        seen["text"] = compiling.inner_text()
        screenshot(page, tmp_path / "compiling.png", publish=False)

    first = generate(page, "a lighthouse at dawn", "128x64", expect="cache: miss", during=mid_compile)
    assert "elapsed" in seen["text"] and "compiles" in seen["text"], seen["text"]
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
    screenshot(page, tmp_path / "screenshot.png")
    assert page.locator("#seed .error").count() == 0  # the seed box keeps its number


def test_a_refused_request_says_why_in_the_output_area_and_leaves_the_seed_box_alone(page: Any) -> None:
    """An empty prompt is refused before any model work: the reason shows in the output area, and the seed box keeps
    its number with no spinner or error badge (the event's progress shows on the gallery only)."""
    page.locator("#randomize input").uncheck()
    page.locator("#seed input").fill("42")
    page.locator("#prompt textarea").fill("   ")
    page.locator("#generate").click()
    page.locator("#info").filter(has_text="Not generated:").filter(has_text="prompt is empty").wait_for()
    seed = page.locator("#seed")
    assert seed.locator("input").input_value() == "42"
    assert "Error" not in seed.inner_text() and seed.locator(".error, .eta-bar, .progress-text").count() == 0


def test_the_prompt_box_counts_and_names_a_text_over_the_limit_and_steps_say_their_range(page: Any) -> None:
    """A 3000-character paste is not cut without a word (the browser's maxlength did): the counter names it and
    Generate refuses it as the API does; the steps slider says its range and what a larger number typed becomes."""
    limit = 2000  # max_prompt_chars' default
    box, prompt = page.locator("#prompt textarea"), page.locator("#prompt")
    box.fill("fox " * 750)
    prompt.filter(has_text=f"3000 / {limit} characters: 1000 over max_prompt_chars").wait_for()
    assert len(box.input_value()) == 3000
    page.locator("#generate").click()
    page.locator("#info").filter(has_text="Not generated:").filter(has_text=f"the limit is {limit}").wait_for()
    box.fill("a fox")
    prompt.filter(has_text=f"5 / {limit} characters").wait_for()
    assert "over" not in prompt.inner_text()
    steps = page.locator("#steps").inner_text()
    assert f"1 to {TINY_OVERRIDES['max_steps']} (max_steps)" in steps and "is set to" in steps


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
    # The shapes are relabelled for two references, as an upload relabels them (it said "+ 1 ref - ready" before,
    # and an edit with two references then compiled unannounced).
    page.locator("#resolution input").click()
    page.locator("ul[role='listbox'] li", has_text="+ 2 refs").first.wait_for()
    page.keyboard.press("Escape")


# --- one source of truth: the dropdown and the table, before and after a restart -------------------------------


def dropdown_labels(page: Any) -> dict[str, str]:
    """The resolution dropdown's options, by shape: "64x64 - ready"."""
    page.locator("#resolution input").click()
    options = page.locator("ul[role='listbox'] li")
    options.first.wait_for()
    labels = [text.replace("✓", "").strip() for text in options.all_inner_texts()]  # ✓ marks the chosen one
    page.keyboard.press("Escape")
    return {label.split(" - ")[0]: label for label in labels}


def table_rows(page: Any) -> dict[str, list[str]]:
    """The status table's rows, by shape: [shape, state, estimate, manifest, ...]."""
    rows = page.locator("#shapes .virtual-row[role='row']")  # Gradio's virtual table (tbody holds a sizing row)
    rows.first.wait_for()
    cells = [[c.strip() for c in row.locator("[role='gridcell']").all_inner_texts()] for row in rows.all()]
    return {row[0]: row for row in cells if row}


def assert_agree(page: Any) -> dict[str, tuple[str, list[str]]]:
    """Each shape's dropdown state word is the table's, and the label's ~seconds the table's estimate."""
    labels, rows = dropdown_labels(page), table_rows(page)
    assert set(labels) <= set(rows), (labels, rows)
    for shape, label in labels.items():
        word = label.split(" - ", 1)[1].split(",")[0]
        row = rows[shape]
        assert row[1].startswith(word), (label, row)
        short = re.search(r"~(\d+ (?:s|min))", label)
        assert (short is None) == (row[2] == ""), (label, row)
        if short:
            assert f"about {short.group(1)}" in row[2] or f"at most {short.group(1)}" in row[2], (label, row)
        assert "_" not in row[1] + row[2] + row[3], row  # words, not enum names (not_compiled)
    return {shape: (labels[shape], rows[shape]) for shape in labels}


def test_the_history_shows_this_sessions_images_and_a_click_reuses_one(page: Any) -> None:
    """Two generations land in the history, newest first, each with its prompt, shape, steps, seed and cache
    result; a click puts the older one's settings back (seed fixed) and "use as reference" takes it."""
    thumbnails = page.locator("#history .thumbnail-item")
    before = thumbnails.count()
    page.locator("#randomize input").uncheck()
    count = page.locator("#images input[type='number']")  # one image a click (an earlier test asked for two)
    count.fill("1")
    count.press("Tab")
    for prompt, seed in (("a red kite over dunes", "11"), ("a blue boat at dusk", "12")):
        page.locator("#prompt textarea").fill(prompt)
        page.locator("#seed input").fill(seed)
        page.locator("#generate").click()
        page.locator("#history .caption-label", has_text=f"{prompt} · ").wait_for()
    assert thumbnails.count() == before + 2
    captions = page.locator("#history .caption-label")
    assert captions.nth(0).inner_text().startswith("a blue boat at dusk · ")
    older = captions.nth(1).inner_text()
    assert older.startswith("a red kite over dunes · ") and "steps, seed 11" in older and "· cache " in older
    page.locator("#prompt textarea").fill("something else")
    page.locator("#seed input").fill("99")
    thumbnails.nth(1).click()
    page.wait_for_function("() => document.querySelector('#prompt textarea').value === 'a red kite over dunes'")
    assert page.locator("#seed input").input_value() == "11"
    assert not page.locator("#randomize input").is_checked()
    references = page.locator("#references img").count()
    page.locator("#history-use-as-reference").click()
    page.wait_for_function(f"() => document.querySelectorAll('#references img').length === {references + 1}")


def test_dropdown_and_table_agree_before_and_after_a_restart(browser: Any, tmp_path: Path, shared_models: Path) -> None:
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.settings import load_settings
    from neuron_app.web.server import build_app, launch

    cache_dir = link_models(tmp_path / "cache", shared_models)

    def start(**overrides: Any) -> Any:
        settings = load_settings(**(TINY_OVERRIDES | {"cache_dir": cache_dir, "server_port": free_port()} | overrides))
        app = build_app(settings, PipelineManager(settings))
        launch(app, block=False)
        return app, f"http://127.0.0.1:{settings.server_port}/"

    app, url = start()
    try:
        page = open_page(browser, url)
        generate(page, "a red kite", "64x64", expect="cache: miss")
        page.locator("#shapes").filter(has_text="ready").wait_for()
        before = assert_agree(page)
        assert before["64x64"][0] == "64x64 - ready" and before["128x128"][1][1] == "not compiled"
        assert "scaled from 64x64" in before["128x128"][1][2]  # learnt from the compile just measured
        page.close()
    finally:
        app.demo.close()

    app, url = start(load_on_start=True)  # the restart: same cache folder, the model loads before any request
    try:
        app.manager.start_warmup().join(120)
        # The served config (the page's first render) already holds the state of now, not the state at launch
        # (before the load): no "loads on the first request", no "Cache (0 B)".
        import httpx

        served = {c.get("props", {}).get("elem_id"): c["props"] for c in httpx.get(url + "config").json()["components"]}
        assert "loaded in" in served["status"]["value"] and "(0 B;" not in served["status"]["value"]
        assert "`/@cache` (" in served["status"]["value"] and "NEURON_APP_CACHE_DIR" in served["status"]["value"]
        assert any(label.startswith("64x64 - precompiled") for label, _value in served["resolution"]["choices"])
        page = open_page(browser, url)
        status = page.locator("#status")
        # The page opens on the state of now (the served config above is its first render); the wait is a ceiling
        # for a busy host, where the first render took more than 5 s.
        status.filter(has_text="loaded in").wait_for()
        after = assert_agree(page)
        label, row = after["64x64"]
        assert label.startswith("64x64 - precompiled") and row[3] == "in the cache"
        assert row[2].startswith("loads from the cache in"), row  # a load, not a compile time
        page.close()
    finally:
        app.demo.close()


# --- live previews: the picture forming in the image slot while the steps run ----------------------------------

#: Records every image the gallery shows (its natural size), so the test sees previews however fast they pass.
WATCH_GALLERY = """() => {
  window.__shown = [];
  const record = (img) => {
    // only a load of what is on show counts: a replaced preview may finish loading after its successor (busy host)
    const src = img.src;
    const note = () => {
      if (img.isConnected && img.src === src) window.__shown.push([img.naturalWidth, img.naturalHeight]);
    };
    if (img.complete && img.naturalWidth) note(); else img.addEventListener('load', note, {once: true});
  };
  new MutationObserver((changes) => {
    for (const change of changes) {
      if (change.type === 'attributes' && change.target.tagName === 'IMG') record(change.target);
      for (const node of change.addedNodes || []) {
        if (node.tagName === 'IMG') record(node);
        if (node.querySelectorAll) node.querySelectorAll('img').forEach(record);
      }
    }
  }).observe(document.querySelector('#gallery'), {subtree: true, childList: true, attributes: true,
                                                   attributeFilter: ['src']});
}"""
SIDE = 256
SHAPE = f"{SIDE}x{SIDE}"
SHOWN = "() => { const img = document.querySelector('#gallery img'); return img ? [img.src, img.naturalWidth] : null; }"


def picture_in(shot: Path, box: dict[str, float]) -> bool:
    """Whether the screenshot holds a picture (not an empty slot) where the gallery's image is."""
    from PIL import Image, ImageStat

    with Image.open(shot) as image:
        crop = image.convert("L").crop((box["x"], box["y"], box["x"] + box["width"], box["y"] + box["height"]))
        return crop.width > 8 and ImageStat.Stat(crop).stddev[0] > 8


def test_previews_show_in_the_image_slot_mid_generation(browser: Any, launch_tiny: Any, tmp_path: Path) -> None:
    """The gallery shows the quarter-size host preview while the steps run, then the image. The run waits after
    its first and second steps until the page has shown that step's preview (and been photographed): the test
    waits on the page's events, never races the steps (a 1024x1024 run raced them before, and lost on a busy
    host)."""
    import threading

    app = launch_tiny(resolutions=[SHAPE], default_resolution=SHAPE, max_steps=4, default_steps=4)
    release = {1: threading.Event(), 2: threading.Event()}  # set once the page showed that step's preview
    page = open_page(browser, app.url)
    with steps_held(app.manager, lambda _request, step: release.get(step), TIMEOUT_MS / 1000):
        try:
            page.locator("#gallery").wait_for()  # the page has rendered
            page.evaluate(WATCH_GALLERY)
            page.locator("#randomize input").uncheck()
            page.locator("#prompt textarea").fill("a harbour at night")
            page.locator("#generate").click()
            preview, side = SIDE // 4, SIDE
            loaded = f"(n) => window.__shown.filter((s) => s[0] === {preview}).length >= n"
            page.wait_for_function(loaded, arg=1, timeout=TIMEOUT_MS)  # step 1's preview, the run held after it
            assert page.evaluate(f"({SHOWN})()")[1] == preview
            box = page.locator("#gallery img").first.bounding_box()
            screenshot(page, tmp_path / "preview.png", publish=False)
            assert box and picture_in(tmp_path / "preview.png", box), "no picture in the image slot during the steps"
            release[1].set()
            page.wait_for_function(loaded, arg=2, timeout=TIMEOUT_MS)  # step 2's, a new preview in the same slot
            release[2].set()
            info = page.locator("#info").filter(has_text=f"{SHAPE},").filter(has_text="cache: miss")
            info.wait_for()
            page.wait_for_function(f"() => ({SHOWN})()[1] === {side}", timeout=TIMEOUT_MS)  # the image replaced it
            shown = page.evaluate("() => window.__shown")
            assert shown[-1] == [side, side] and [side, side] not in shown[: shown.index([preview, preview])], shown
        finally:
            for event in release.values():
                event.set()
            page.close()


def test_stop_ends_the_generation_at_the_next_step_and_the_next_one_needs_no_compile(
    browser: Any, launch_tiny: Any, tmp_path: Path
) -> None:
    """Stop during the steps: the manager reports the request cancelled (never an image), the page says "stopped at
    step k of n" with no error badge, and the next Generate is served from the compiled graph."""
    import threading

    from neuron_app.engine.records import RequestFailed

    app = launch_tiny(resolutions=["256x256"], default_resolution="256x256", max_steps=200, default_steps=200)
    app.manager.generate("warm", "256x256", 1, 1)  # compiled before the page asks
    compiles = app.manager.status().compiles
    cancelled = threading.Event()
    app.manager.subscribe(lambda e: cancelled.set() if isinstance(e, RequestFailed) and e.result == "cancelled" else 0)
    page = open_page(browser, app.url)
    try:
        page.locator("#prompt textarea").fill("a harbour at night")
        page.locator("#generate").click()
        page.locator("#info").filter(has_text=re.compile(r"256x256 - step ([2-9]|\d\d+)/200")).wait_for()
        page.locator("#stop").click()
        assert cancelled.wait(60), "the manager never reported the request cancelled"
        # The output area says where it stopped, as the server counts it, and the gallery wears no "Error" badge.
        stopped = page.locator("#info").filter(has_text=re.compile(r"256x256 - stopped at step \d+ of 200"))
        stopped.wait_for()
        assert "cache:" not in page.locator("#info").inner_text()  # no record: no image was made
        page.screenshot(path=str(tmp_path / "stopped.png"), full_page=True)
        badge = page.locator("#gallery").get_by_text("Error", exact=True)
        assert badge.count() == 0 or not badge.first.is_visible(), "Stop left an Error badge on the gallery"
        page.locator("#generate").click()
        info = page.locator("#info").filter(has_text="256x256,").filter(has_text="cache: memory")
        info.wait_for()
        # the usage fields are one click away (a closed <details>): in the text, not drawn
        assert "compile_s 0.0" in info.text_content() and app.manager.status().compiles == compiles
    finally:
        page.close()


def test_one_image_in_the_history_is_a_thumbnail_not_a_band(browser: Any, launch_tiny: Any) -> None:
    """The first hour's item 11: Gradio's gallery gave a lone image the whole row (a square as wide as the page,
    cropped to a band); the history keeps its six columns from the first image on."""
    app = launch_tiny()
    page = open_page(browser, app.url)
    try:
        page.locator("#prompt textarea").fill("a red kite over dunes")
        page.locator("#generate").click()
        page.locator("#history .thumbnail-item").first.wait_for()
        image = page.locator("#history .thumbnail-item").first.bounding_box()
        gallery = page.locator("#history").bounding_box()
        assert image and gallery and image["width"] < gallery["width"] / 4, (image, gallery)
        assert image["height"] <= gallery["height"], (image, gallery)  # whole, not cropped by the panel
    finally:
        page.close()
