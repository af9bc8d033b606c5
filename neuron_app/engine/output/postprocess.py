"""The post-processing stage: what the host does to an image after the device made it (the safety check, the
AI-content marks, the encode), on a bounded number of host slots, so a device lane takes its next request at once.

A device lane is the manager's `Lane` (its device lock, first come first served). After its device work a request
takes a post slot while it still holds the lane (backpressure: with every slot busy the lane waits), then lets the
lane go and finishes on its own thread. The entries (Gradio's queue, the jobs' workers) run up to `request_slots`
requests at once, so the next request is already waiting on the lane when it is let go. `postprocess_workers = 0`
is the in-line path: the lane does the host work itself before it takes the next request (the bench's baseline).

A flagged image raises here, before any encode: it is never marked, stored or returned; an error in the stage is
that request's error only. Tensor parallel: only rank 0 runs `_run`, so only rank 0 has a stage; replicas: each
replica's manager has its own.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from neuron_app import tracing

#: The device lane's last holds kept for the idle fraction (the bench, status).
LANE_LOG = 256
#: How many of the last holds the median device time per request is taken over (`snapshot`'s `median_s`), and
#: how many timed runs are kept per shape (`snapshot`'s `shape_s`).
MEDIAN_OF = 32
#: Shapes whose run times are kept (the oldest forgotten first): a server serves a few configured sizes.
SHAPES_TIMED = 64


def post_workers(settings: Any) -> int:
    return int(getattr(settings, "postprocess_workers", 0))


def request_slots(settings: Any) -> int:
    """Requests an entry runs at once: one per device lane, plus one per post slot (their host work)."""
    return settings.device_lanes + post_workers(settings)


class Lane:
    """The device lock, served in arrival order, that counts its waiters and logs the device work done under it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0  # the next ticket handed out
        self._serving = 0  # the ticket that may hold the lane
        #: (start, end) of each request's device work, perf_counter: the host work after it is not in it, even
        #: in-line where the lane stays held through it (what the idle fraction compares)
        self.holds: deque[tuple[float, float]] = deque(maxlen=LANE_LOG)
        #: per shape, (steps, seconds) of its last runs (no compile in them): a queue place's ETA per shape and steps
        self.timed: dict[str, deque[tuple[int, float]]] = {}
        self.current: tuple[str, int, float] | None = None  # the request on the device: shape, steps, since

    def acquire(self, work: Any = None) -> bool:
        """Wait for the lane; `work` (a request with `resolution` and `steps`) is what it holds it for."""
        with self._cond:
            ticket = self._next
            self._next += 1
            while ticket != self._serving:
                self._cond.wait()
            if work is not None:
                self.current = (str(work.resolution), int(work.steps), time.perf_counter())
        return True

    def busy(self, start: float, end: float, work: Any = None, run_s: float | None = None) -> None:
        """A request's device work ran from `start` to `end` (perf_counter); `run_s` of it was `work`'s run."""
        with self._cond:
            self.holds.append((start, end))
            self.current = None
            if work is not None and run_s is not None and work.steps > 0:
                shape = str(work.resolution)
                runs = self.timed.pop(shape, None) or deque(maxlen=MEDIAN_OF)
                runs.append((int(work.steps), run_s))
                self.timed[shape] = runs  # the newest shape last: the oldest is forgotten first
                while len(self.timed) > SHAPES_TIMED:
                    self.timed.pop(next(iter(self.timed)))

    def release(self) -> None:
        with self._cond:
            self._serving += 1
            self.current = None
            self._cond.notify_all()

    def locked(self) -> bool:
        with self._cond:
            return self._next != self._serving

    @property
    def waiting(self) -> int:
        with self._cond:
            return max(0, self._next - self._serving - 1)

    @property
    def served(self) -> int:
        """Requests that have let the lane go since start: a queue place counts down by it (web/queue_place.py)."""
        with self._cond:
            return self._serving

    def shape_times(self) -> dict[str, Any]:
        """`shape_s`: per shape, the median seconds per step and per step count of its last runs; `current`: the
        request on the device (shape, steps, seconds since it took the lane)."""
        with self._cond:
            timed = {shape: list(runs) for shape, runs in self.timed.items()}
            current = self.current
        shapes: dict[str, Any] = {}
        for shape, runs in timed.items():
            counts = sorted({steps for steps, _ in runs})
            by_steps = {str(n): round(statistics.median(s for k, s in runs if k == n), 4) for n in counts}
            shapes[shape] = {"per_step_s": round(statistics.median(s / k for k, s in runs), 4), "by_steps": by_steps}
        running = None
        if current is not None:
            shape, steps, since = current
            running = {"resolution": shape, "steps": steps, "elapsed_s": round(time.perf_counter() - since, 3)}
        return {"shape_s": shapes, "current": running}

    def __enter__(self) -> Lane:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def idle_fraction(holds: list[tuple[float, float]]) -> float | None:
    """The device's idle share between the first request's device work and the last one's end (None under two)."""
    if len(holds) < 2:
        return None
    span = holds[-1][1] - holds[0][0]
    busy = sum(end - start for start, end in holds)
    return max(0.0, 1.0 - busy / span) if span > 0 else 0.0


class PostStage:
    """`workers` host slots for the work after the device; 0: in-line (the lane keeps the device meanwhile)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._slots = threading.BoundedSemaphore(max(workers, 1))
        self._lock = threading.Lock()
        self.waiting = 0  # lanes waiting for a free slot (backpressure)
        self.running = 0
        self.done = 0
        self.failed = 0
        self.seconds = 0.0  # host time in the stage, summed

    @property
    def overlapped(self) -> bool:
        return self.workers > 0

    def take(self) -> None:
        """A slot for the next image; blocks, holding the lane, while all are busy."""
        if not self.overlapped:
            return
        with self._lock:
            self.waiting += 1
        try:
            with tracing.span("postprocess_wait"):
                self._slots.acquire()
        finally:
            with self._lock:
                self.waiting -= 1

    @contextlib.contextmanager
    def running_in_slot(self) -> Iterator[None]:
        """The host work of one image, in the slot `take` gave (in-line: on the lane); the slot is given back."""
        start = time.perf_counter()
        with self._lock:
            self.running += 1
        ok = False
        try:
            with tracing.span("postprocess", overlapped=self.overlapped):
                yield
            ok = True
        finally:
            with self._lock:
                self.running -= 1
                self.seconds += time.perf_counter() - start
                self.done += ok
                self.failed += not ok
            if self.overlapped:
                self._slots.release()

    def snapshot(self, lane: Lane) -> dict[str, Any]:
        """Both stages' depths: requests waiting for the device and on it; images waiting for a slot and in one."""
        with self._lock:
            post = {"workers": self.workers, "waiting": self.waiting, "running": self.running}
            post |= {"done": self.done, "failed": self.failed, "seconds": round(self.seconds, 3)}
        idle = idle_fraction(list(lane.holds))
        device: dict[str, Any] = {"waiting": lane.waiting, "running": int(lane.locked()), "served": lane.served}
        device["idle_fraction"] = None if idle is None else round(idle, 4)
        # The device seconds of the last requests, for a queue place's ETA: the median, as a hold that compiled is
        # many times a warm one (its compile is in the hold; the ETA adds a cold shape's estimate on its own).
        recent = sorted(end - start for start, end in list(lane.holds)[-MEDIAN_OF:])
        device["median_s"] = round(statistics.median(recent), 3) if recent else None
        device |= lane.shape_times()
        return {"device": device, "post": post}


def finish(manager: Any, req: Any, image: Any, outcome: Any, safety: str | None = None, **timings: Any) -> Any:
    """One image's host work after the device: the safety check unless the lane ran it on the device (`safety`; a
    flagged image raises `ContentRefused`, so nothing marks, stores or returns it), the record, then the marked,
    signed file (`record.encoded`, which the entries' writers reuse: engine/output/images.py)."""
    from neuron_app.engine.output.images import encoded
    from neuron_app.engine.records import GenerationRecord
    from neuron_app.engine.trust.marks import Marker

    safety = manager.safety.check(image) if safety is None else safety
    with manager._state_lock:
        manager._hits[outcome.resolution] = manager._hits.get(outcome.resolution, 0) + 1
    settings = manager.settings
    record = GenerationRecord(
        resolution=str(req.resolution),
        steps=req.steps,
        seed=req.seed,
        prompt=req.prompt,
        cache=outcome.cache,
        compiled=outcome.compiled,
        compile_s=round(outcome.compile_s, 4),
        inference_s=round(timings["inference_s"], 4),
        total_s=0.0,
        graphs_compiled=outcome.graphs,
        model=settings.model,
        image=image,
        lora=req.lora,
        lora_scale=req.lora_scale,
        loras=[{"name": name, "scale": scale} for name, scale in req.loras],
        lora_switch_s=round(timings["switch_s"], 6),
        references=[r.info() for r in req.references],
        source=None if req.source is None else {**req.source.info(), "strength": req.strength},
        eager_compiles=timings["eager"],
        safety=safety,
        queue_s=round(timings["queue_s"], 4),
        device_s=round(timings["device_s"], 4),
        placement={"name": manager.placement.name, "cores": dict(manager.placement.cores)},
    )
    output = getattr(req, "output", None) or ("png", None)  # OpenAI's output_format and output_compression
    encoded(record, Marker.for_settings(settings), *output)
    record.total_s = round(time.perf_counter() - timings["start"], 4)
    return record
