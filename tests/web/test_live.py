"""The output area names what the device really waits for: the edit graph that compiles (not its shape's
precompiled text-to-image graph), and the model load with its last measured time, also while another thread
(load_on_start) is loading it."""

from __future__ import annotations

import threading
from typing import Any

from PIL import Image

from neuron_app.engine.manager import PipelineManager
from neuron_app.engine.records import ProgressEvent
from neuron_app.web.page.views import progress_markdown
from tests.support import wait_for


def test_a_first_edit_on_a_precompiled_shape_says_its_edit_graph_compiles(make_settings: Any) -> None:
    settings = make_settings()
    PipelineManager(settings).compile_shape("64x64")  # 64x64 precompiled: its row says "loads from the cache"
    manager = PipelineManager(settings)
    row = manager.status().shapes["64x64"]
    assert row.estimate is not None and row.estimate.kind == "load"
    events: list[ProgressEvent] = []
    manager.generate("edit", "64x64", 1, 0, references=[Image.new("RGB", (64, 64))], progress=events.append)
    compiling = [e for e in events if e.phase == "compiling"]
    edit = next(e for e in compiling if e.graph != "64x64")  # the text-to-image graph loads first, then the edit's
    assert edit.graph.startswith("64x64 + 1 ref"), edit
    line = progress_markdown(edit, row, 3.0)  # live.py passes the shape's row: the event's graph wins
    assert line.startswith(f"**{edit.graph} - compiling (first use)**"), line
    assert "loading its precompiled graph" not in line and "loads from the cache" not in line


def test_loading_the_model_says_its_last_load_time_even_while_another_thread_loads(make_settings: Any) -> None:
    settings = make_settings()
    first: list[ProgressEvent] = []
    PipelineManager(settings).ensure_loaded(progress=first.append)
    (loading,) = [e for e in first if e.phase == "loading"]
    assert loading.estimate is None
    assert progress_markdown(loading, None, 1.0).startswith("**Loading the model (first request; no load measured")

    restarted = PipelineManager(settings)
    events: list[ProgressEvent] = []
    restarted._load_lock.acquire()  # as load_on_start's thread holds it while it loads
    waiting = threading.Thread(target=restarted.ensure_loaded, kwargs={"progress": events.append})
    try:
        waiting.start()
        event = wait_for(lambda: events[:1], 60, "the loading event while another thread loads")[0]
    finally:
        restarted._load_lock.release()
    waiting.join(timeout=300)
    assert event.phase == "loading" and event.estimate is not None and event.estimate.seconds > 0
    line = progress_markdown(event, None, 2.0)
    assert line.startswith("**Loading the model (~") and "elapsed" in line, line


def test_the_result_line_names_the_source_mask_and_strength(make_settings: Any) -> None:
    """An inpaint's and an image-to-image's line say what they started from, not only the shape and seed."""
    from neuron_app.web.page.views import info_markdown
    from tests.support import left_half_mask, png, source_image

    manager = PipelineManager(make_settings())
    picture = png(source_image())
    inpainted = manager.generate("paint", "64x64", 2, 1, image=picture, mask=left_half_mask(), strength=0.5)
    line = info_markdown(inpainted)
    assert f"inpaint of a {inpainted.source['size']} source, mask 50% of the image, strength 0.5" in line, line
    redrawn = manager.generate("paint", "64x64", 2, 1, image=picture)
    assert f"image-to-image from a {redrawn.source['size']} source, strength 1" in info_markdown(redrawn)


def test_a_page_slower_than_the_steps_shows_the_step_the_server_is_on() -> None:
    """The first hour (turn 6): the page said step 5 while the server decoded, so Stop named a step long past. The
    output area folds the events that came while the page took its last line: its next line is the newest."""
    from neuron_app.web.page.live import live

    emitted, go = threading.Event(), threading.Event()

    def work(on_event: Any) -> str:
        for step in range(1, 11):
            on_event(ProgressEvent("denoising", "64x64", step, 10, f"Step {step}/10"))
        emitted.set()  # all ten steps came while the page still held its first line
        go.wait(60)
        return "made"

    lines = live(work, lambda: None, lambda _event: None, lambda text: text)  # type: ignore[arg-type,return-value]
    next(lines)
    assert emitted.wait(60)
    assert "64x64 - step 10/10" in next(lines)
    go.set()
    try:
        while True:
            next(lines)
    except StopIteration as end:
        assert end.value == "made"
