"""The page's output area while a request runs: what the device does now and for how long, updated live.

Gradio's own progress shows only a spinner and a timer on the gallery; on Neuron a first compile is a wait of
minutes, so the page says what it waits for. The words come from the manager's progress events and the shape's
status record (state and estimate), never from parsing messages.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Generator
from typing import Any

from neuron_app.engine.records import ManagerStatus, ProgressCallback, ProgressEvent, ShapeStatus
from neuron_app.errors import Cancelled
from neuron_app.web.page.views import progress_markdown

#: How often the elapsed time in the output area moves on (seconds).
TICK_S = 1.0
_DONE = object()


def live(
    work: Callable[[ProgressCallback], Any],
    status: Callable[[], ManagerStatus],
    forward: ProgressCallback,
    wrap: Callable[[str], Any],
    tick_s: float = TICK_S,
) -> Generator[Any, None, Any]:
    """Run `work(on_event)` in a worker thread; yield `wrap(markdown)` on every event and every `tick_s`;
    return what `work` returned, or raise what it raised. Events also go to `forward` (Gradio's progress).
    Closing this generator (the page's Stop: Gradio closes a cancelled event's iterator) stops the work at its
    next denoising step (engine/steps.py)."""
    events: queue.Queue[Any] = queue.Queue()
    outcome: dict[str, Any] = {}
    stop = threading.Event()

    def on_event(event: ProgressEvent) -> None:
        if stop.is_set() and event.phase in ("denoising", "decoding"):
            raise Cancelled("stopped on the page")
        forward(event)
        events.put(event)

    def target() -> None:
        try:
            outcome["value"] = work(on_event)
        except BaseException as exc:  # handed to the page's thread, which raises it there
            outcome["error"] = exc
        finally:
            events.put(_DONE)

    threading.Thread(target=target, name="page-request", daemon=True).start()
    current: ProgressEvent | None = None
    shape: ShapeStatus | None = None
    since = time.monotonic()
    compiled_s: float | None = None
    while True:
        try:
            item = events.get(timeout=tick_s)
        except queue.Empty:
            item = None
        if item is _DONE:
            break
        if item is not None:
            now = time.monotonic()
            if current is None or (item.phase, item.resolution) != (current.phase, current.resolution):
                if current is not None and current.phase == "compiling":
                    compiled_s = now - since
                since = now
                if item.phase == "compiling":
                    compiled_s = None
                    shape = status().shapes.get(item.resolution or "")  # its state and estimate, as the table
            current = item
        if current is not None:
            try:
                yield wrap(progress_markdown(current, shape, time.monotonic() - since, compiled_s))
            except GeneratorExit:  # the page's Stop: the worker ends at its next step, its images never kept
                stop.set()
                raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
