"""The page's Stop and its queue place, in a real headless browser (the first hour, turn 6: N1, N2, F3).

What a user met: Stop after the image was shown wrote "no image was made" beside it; Stop during a compile left a
red Error badge; Stop of a several-image request threw away the images already made; a second tab waiting for the
device showed only Gradio's spinner. Each test waits on events (the manager's records, the page's own answers),
never on the clock.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from neuron_app.engine.records import GenerationRecord, ProgressEvent, RequestFailed
from tests.support import steps_held
from tests.web.test_browser import TIMEOUT_MS, browser, open_page

pytestmark = pytest.mark.browser
__all__ = ["browser"]  # the module's chromium, shared with test_browser.py's fixture

LONG = "256x256"  # 200 steps here take seconds on the CPU: time to press Stop mid-way
COLD = "128x64"  # compiled by no test before the one that stops its compile


@pytest.fixture(scope="module")
def app(launch_tiny: Any) -> Any:
    shapes = {"resolutions": ["64x64", COLD, LONG], "default_resolution": "64x64"}
    # No post slots: Gradio runs one Generate at a time, so a second tab's waits in Gradio's own queue.
    return launch_tiny(**shapes, max_steps=200, max_images=3, postprocess_workers=0)


@pytest.fixture
def page(app: Any, browser: Any) -> Iterator[Any]:
    page = open_page(browser, app.url)
    page.locator("#gallery").wait_for()
    yield page
    page.close()


def ask(page: Any, shape: str, steps: int, images: int = 1) -> None:
    """Fill the form as a user does and click Generate."""
    page.locator("#resolution input").click()
    page.locator("ul[role='listbox'] li", has_text=shape).first.click()
    for box, value in (("#steps", steps), ("#images", images)):
        field = page.locator(f"{box} input[type='number']")
        field.fill(str(value))
        field.press("Tab")
    page.locator("#prompt textarea").fill("a lighthouse at dawn")
    page.locator("#generate").click()


def no_error_badge(page: Any) -> bool:
    badge = page.locator("#gallery").get_by_text("Error", exact=True)
    return badge.count() == 0 or not badge.first.is_visible()


def answer_of(app: Any, name: str) -> Any:
    """A predicate for the browser's response to the page's own event `name` (outside the queue)."""
    index = next(i for i, fn in app.demo.fns.items() if fn.name == name or any(e == name for _id, e in fn.targets))
    return lambda r: r.url.endswith("/run/predict") and json.loads(r.request.post_data)["fn_index"] == index


def cancelled_watch(app: Any) -> threading.Event:
    cancelled = threading.Event()
    app.manager.subscribe(lambda e: cancelled.set() if isinstance(e, RequestFailed) and e.result == "cancelled" else 0)
    return cancelled


def test_stop_after_the_image_is_shown_leaves_the_image_and_its_line(app: Any, page: Any) -> None:
    """N1: nothing runs, so Stop changes nothing: its answer (watched on the wire) and the next status tick leave
    the image and its result line, with no "no image was made"."""
    ask(page, "64x64", 2)
    info = page.locator("#info").filter(has_text="cache:")
    info.wait_for()
    before = info.inner_text()
    with page.expect_response(answer_of(app, "stopped")):
        page.locator("#stop").click()
    with page.expect_response(answer_of(app, "tick"), timeout=TIMEOUT_MS):  # and the next status tick
        pass
    assert page.locator("#info").inner_text() == before
    assert "Stopped" not in before and page.locator("#gallery img").count() >= 1 and no_error_badge(page)


def test_stop_during_a_compile_says_so_with_no_error_badge(app: Any, page: Any) -> None:
    """F3: Stop while the shape compiles for its first use: the compile goes on (kept for later), the request ends
    before its first step, and the page says that, with no Error badge on the gallery."""
    cancelled = cancelled_watch(app)
    ask(page, COLD, 2)
    page.locator("#info").filter(has_text=f"{COLD} - compiling (first use)").wait_for()
    page.locator("#stop").click()
    page.locator("#info").filter(has_text=f"{COLD} - stopped during its first-use compile").wait_for()
    assert cancelled.wait(TIMEOUT_MS / 1000), "the manager never reported the request cancelled"
    assert app.manager.status().shapes[COLD].state.value == "ready"  # the compile was kept
    text = page.locator("#info").inner_text()
    assert "no image was made" in text and "cache:" not in text and no_error_badge(page), text


def test_stop_in_the_second_of_three_images_keeps_the_first(app: Any, page: Any, tmp_path: Any) -> None:
    """N13 and the step the page names: Stop during image 2 of 3 keeps image 1 (shown, with its line) and names
    the step the server stopped at, the step the page was showing or the one after (never "decoding"). The step
    line says what the noisy preview beside it is (N5). Image 2 waits after its second step until the page has
    shown a step line and Stop was pressed: on a busy machine (a `.ci/run` at stop 62) the three images had all
    run before the browser drew one of image 2's steps."""
    app.manager.generate("warm", LONG, 1, 1)  # compiled before: the steps are what runs
    made, cancelled = threading.Event(), cancelled_watch(app)
    app.manager.subscribe(lambda e: made.set() if isinstance(e, GenerationRecord) else 0)
    release = threading.Event()  # set once the page showed image 2's step line and Stop was pressed
    with steps_held(
        app.manager, lambda image, step: release if (image, step) == (2, 2) else None, TIMEOUT_MS / 1000
    ) as images:
        try:
            ask(page, LONG, 200, images=3)
            assert made.wait(TIMEOUT_MS / 1000), "the first image was never made"
            shown = page.locator("#info").filter(has_text=re.compile(rf"{LONG} - step \d+/200"))
            shown.wait_for()
            assert "the preview is this step's noisy image" in shown.inner_text()  # N5: what the preview beside it is
            page.locator("#stop").click()
        finally:
            release.set()
    assert cancelled.wait(TIMEOUT_MS / 1000), "the manager never reported the request cancelled"
    assert len(images) == 2, len(images)  # held in image 2, stopped there: image 3 never ran
    stopped = page.locator("#info").filter(
        has_text=re.compile(rf"{LONG} - stopped at step \d+ of 200 \(image 2 of 3\)")
    )
    stopped.wait_for()
    text = stopped.inner_text()
    assert "1 image(s) finished before it are kept below" in text and text.count("cache:") == 1, text
    page.wait_for_function("() => document.querySelectorAll('#gallery img').length === 1", timeout=TIMEOUT_MS)
    page.screenshot(path=str(tmp_path / "stop3.png"), full_page=True)
    print("GALLERY", page.locator("#gallery").inner_html()[:3000])
    assert no_error_badge(page)


def test_a_tab_behind_another_request_shows_its_place_and_eta(app: Any, page: Any, browser: Any) -> None:
    """N2: while another request holds the device (here one held at its first step by its own progress callback),
    the page's request says how many are ahead and the ETA the API would give, then runs. A second tab's Generate,
    still in Gradio's queue behind it, is stopped there: it ends as it starts, with nothing made."""
    app.manager.generate("warm", "64x64", 1, 1)  # a timed request: the ETA has a median to go on
    holding, release = threading.Event(), threading.Event()

    def hold(event: ProgressEvent) -> None:
        if event.phase == "denoising":
            holding.set()
            release.wait(TIMEOUT_MS / 1000)

    other = threading.Thread(target=app.manager.generate, args=("another", "64x64", 2, 3), kwargs={"progress": hold})
    other.start()
    second = open_page(browser, app.url)
    try:
        assert holding.wait(TIMEOUT_MS / 1000)
        ask(page, "64x64", 2)
        waiting = page.locator("#info").filter(has_text="Waiting for the device · 1 request ahead of this one")
        waiting.wait_for()
        assert re.search(r"ETA ~\d+ s", waiting.inner_text()), waiting.inner_text()
        second.locator("#gallery").wait_for()
        ask(second, "64x64", 2)
        second.locator("#gallery").filter(has_text=re.compile(r"queue: ?1")).wait_for()  # Gradio's own queue
        with second.expect_response(answer_of(app, "stopped")):
            second.locator("#stop").click()
    finally:
        release.set()
        other.join()
    page.locator("#info").filter(has_text="64x64,").filter(has_text="cache: memory").wait_for()
    second.locator("#info").filter(has_text="Stopped before it started: no image was made.").wait_for()
    assert second.locator("#gallery img").count() == 0 and no_error_badge(second)
    second.close()
