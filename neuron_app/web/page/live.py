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
from dataclasses import dataclass, field
from typing import Any

from neuron_app.engine.records import GenerationRecord, ManagerStatus, ProgressCallback, ProgressEvent, ShapeStatus
from neuron_app.errors import Cancelled
from neuron_app.web.page.views import progress_markdown

#: How often the elapsed time in the output area moves on (seconds).
TICK_S = 1.0
#: Sessions whose Generate (and Stop's note) are kept at most; past this the oldest go (pages that left).
MAX_SESSIONS = 1000
_DONE = object()
_STOP = object()  # the page's Stop, put in the queue to wake the loop


def keep_newest(per_session: dict[Any, Any]) -> None:
    """At most MAX_SESSIONS sessions' entries: the oldest go (sessions that left never come back for theirs)."""
    while len(per_session) > MAX_SESSIONS:
        per_session.pop(next(iter(per_session)))


@dataclass
class Run:
    """A session's Generate while it runs, as Stop needs it: the last progress event, the images made so far, and
    the flag Stop sets (the page's request then ends at once with what was made; web/page/ui.py)."""

    images: int = 1
    event: ProgressEvent | None = None
    kept: list[tuple[GenerationRecord, str, str]] = field(default_factory=list)  # each image: record, file, line
    stopping: threading.Event = field(default_factory=threading.Event)
    wake: Callable[[], None] | None = None  # set by `live`: its loop sees the Stop at once

    def request_stop(self) -> None:
        self.stopping.set()
        if self.wake is not None:
            self.wake()


class Runs:
    """Each session's running Generate, for Stop. Stop is the page's own flag, not Gradio's cancel: the request's
    generator ends with its own last answer (where it stopped, the images made), so no cancelled event's state
    (an Error badge, a late progress line over Stop's note) can reach the page after it. A Generate still in
    Gradio's queue when Stop is pressed is marked by its event id and ends as soon as it starts."""

    def __init__(self) -> None:
        self._runs: dict[str | None, Run] = {}
        self._started: dict[str, None] = {}  # event ids that have started (newest MAX_SESSIONS)
        self._stopped_early: dict[str, None] = {}  # event ids stopped while still in Gradio's queue

    def start(self, session: str | None, images: int, event_id: str | None) -> Run | None:
        """The session's new run; None when Stop was pressed while it waited in Gradio's queue."""
        if event_id is not None:
            self._started[event_id] = None
            keep_newest(self._started)
            if event_id in self._stopped_early:
                del self._stopped_early[event_id]
                return None
        run = self._runs[session] = Run(images=max(1, images))
        keep_newest(self._runs)  # a request whose page left without Stop leaves its entry here
        return run

    def end(self, session: str | None, run: Run) -> None:
        if self._runs.get(session) is run:
            del self._runs[session]

    def stop(self, session: str | None, queued: set[str]) -> bool:
        """Stop for the session: its running Generate, else those of `queued` (its events in Gradio's queue) that
        have not started. False when nothing was there to stop (the page stays as it is)."""
        run = self._runs.pop(session, None)
        if run is not None:
            run.request_stop()
            return True
        waiting = [event_id for event_id in queued if event_id not in self._started]
        for event_id in waiting:
            self._stopped_early[event_id] = None
        keep_newest(self._stopped_early)
        return bool(waiting)


def live(
    work: Callable[[ProgressCallback], Any],
    status: Callable[[], ManagerStatus],
    forward: ProgressCallback,
    wrap: Callable[[str], Any],
    tick_s: float = TICK_S,
    waiting: Callable[[float], str | None] | None = None,
    run: Run | None = None,
) -> Generator[Any, None, Any]:
    """Run `work(on_event)` in a worker thread; yield `wrap(markdown)` for the newest event each time the page
    takes a line (events that came meanwhile are folded in: a page slower than the steps shows the step the
    server is on, the one Stop would name, not one long past), and every `tick_s`; before the first event,
    `waiting(elapsed)`'s line if it has one (the queue place). Return what `work` returned, or raise what it
    raised. Events also go to `forward` (Gradio's progress). The run's Stop (or closing this generator: Gradio
    closes a cancelled event's iterator, e.g. when the page goes) stops the work at its next denoising step
    (engine/steps.py); a Stop raises `Cancelled` here at once (a compile or a wait for the device goes on)."""
    events: queue.Queue[Any] = queue.Queue()
    outcome: dict[str, Any] = {}
    stop = run.stopping if run is not None else threading.Event()
    if run is not None:
        run.wake = lambda: events.put(_STOP)

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
    since = started = time.monotonic()
    compiled_s: float | None = None
    done = False
    while not done:
        try:
            items = [events.get(timeout=tick_s)]
        except queue.Empty:
            items = []
        while items and items[-1] is not _DONE:  # every event already there: the line shows the newest
            try:
                items.append(events.get_nowait())
            except queue.Empty:
                break
        for item in items:
            if item is _DONE:
                done = True
                break
            if item is _STOP:
                continue
            now = time.monotonic()
            if current is None or (item.phase, item.resolution) != (current.phase, current.resolution):
                if current is not None and current.phase == "compiling":
                    compiled_s = now - since
                since = now
                if item.phase == "compiling":
                    compiled_s = None
                    shape = status().shapes.get(item.resolution or "")  # its state and estimate, as the table
            current = item
        if done:
            break
        if stop.is_set():
            raise Cancelled("stopped on the page")
        if current is not None:
            line: str | None = progress_markdown(current, shape, time.monotonic() - since, compiled_s)
        else:
            line = waiting(time.monotonic() - started) if waiting is not None else None
        if line is not None:
            try:
                yield wrap(line)
            except GeneratorExit:  # Gradio closed it (the page went): the worker ends at its next step
                stop.set()
                raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
