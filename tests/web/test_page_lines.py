"""What the page's lines say about an image and the form, as a user reads them (the first hour, turn 6): the marks
line below the watermark's 256 px (N6), and what more steps do to tiny-shapes (N4), where the steps are chosen."""

from __future__ import annotations

from typing import Any

import httpx

from tests.support import SHAPES_OVERRIDES, page_generate


def test_the_marks_line_says_no_watermark_under_256_px(launched_app: Any) -> None:
    """N6: every 128x128 image said "marked: c2pa, iptc, watermark" while its PNG said "watermark: none"."""
    message = page_generate(launched_app, ["a red kite", "64x64", 2, 1, 1, False])
    info = message["output"]["data"][1]
    marked = info.split("marked: ", 1)[1].split("\n", 1)[0]
    assert marked.startswith("c2pa, iptc (no watermark: 64x64 is under 256x256)"), marked
    assert "watermark" not in marked.split(" (", 1)[0], marked


def test_the_steps_slider_says_tiny_shapes_is_made_for_4_steps(launch_tiny: Any) -> None:
    """N4: at 8 and 16 steps tiny-shapes draws ragged edges; the slider offered 1-16 with no word on it."""
    app = launch_tiny(**SHAPES_OVERRIDES)
    config = httpx.get(app.url + "config", timeout=60).json()
    steps = next(c for c in config["components"] if c.get("props", {}).get("elem_id") == "steps")
    assert "tiny-shapes is trained for 4 steps (the default)" in steps["props"]["info"], steps["props"]["info"]
    assert "8 and more make its edges ragged" in steps["props"]["info"]


def test_with_a_reference_the_hint_speaks_of_the_edit_graph(launched_app: Any) -> None:
    """F9 (turn 5, partly fixed in turn 6): with a reference uploaded the list said "64x64 + 1 ref - not compiled"
    while the hint under it still said the text-to-image graph's "64x64 is ready: no compile"."""
    from neuron_app.web.page.edit_controls import edit_info

    page_generate(launched_app, ["a red kite", "64x64", 2, 1, 1, False])  # the text-to-image graph is ready
    status = launched_app.manager.status()
    assert status.shapes["64x64"].state.value == "ready"
    hint = edit_info(status, ["64x64"], "64x64")
    assert hint.startswith("64x64 + 1 ref: its edit graph is not compiled in this process"), hint
    assert "ready: no compile" not in hint
