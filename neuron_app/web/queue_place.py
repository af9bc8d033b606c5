"""Where an API request stands in the device queue, and when its image should come: the figures an API caller
gets (headers `X-Queue-Position` and `X-Queue-Eta-Seconds`, a job's `queue_position` and `queue_eta_s`, a stream's
comment lines), counted as the page's queue counts them.

The page's figures are Gradio's: its rank in Gradio's queue, and an ETA from the mean time of the requests before.
An API request waits outside Gradio's queue, on the same device lane (engine/output/postprocess.py, first come
first served), so its place is taken when it is admitted: the requests ahead of it are those the admission check
counts (Gradio's waiting and running, the API's in flight, less those already past the device), and the place
counts down by each request that lets the lane go after that. The ETA (issue 52 row 30: it ignored shape and steps)
is, from the lane's own log of the last runs per shape (engine/output/postprocess.py `shape_s`):
- the request on the device: its run at its shape and steps, less the time it has had (at least one more step);
- each request waiting ahead of it: the median device time of the last requests (their shapes are not known here),
  spread over the lanes;
- its own images: the median run at its shape with its steps, else the shape's median seconds per step times its
  steps; a shape never run is scaled by pixels from the nearest shape that was;
- its shape's compile (or graph load) estimate when that shape is not ready: the status table's estimate
  (engine/cache/estimates.py).
A manager that does not report its lane (replicas without these fields) gives a place that does not count down
and no ETA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from neuron_app.engine.records import ManagerStatus, ShapeState

#: Queued jobs' places remembered at most (each a few numbers).
KEPT_PLACES = 4096


def _device(status: ManagerStatus) -> dict[str, Any]:
    return (status.stages or {}).get("device") or {}


@dataclass(frozen=True)
class QueuePlace:
    """A request's place when it was admitted; `position` and `eta_s` read it against a later status."""

    ahead: int  # requests ahead of this one when admitted: on the device or waiting for it
    served: int | None  # the lane's `served` count then (None: the manager does not report it)
    lanes: int
    images: int = 1
    resolution: str | None = None
    steps: int | None = None

    @classmethod
    def taken(cls, status: ManagerStatus, ahead: int, lanes: int) -> QueuePlace:
        served = _device(status).get("served")
        return cls(max(0, ahead), served if isinstance(served, int) else None, max(1, lanes))

    def position(self, status: ManagerStatus) -> int:
        """Requests still ahead: 0 when this one is next or on the device."""
        now = _device(status).get("served")
        if self.served is None or not isinstance(now, int):
            return self.ahead
        return max(0, self.ahead - (now - self.served))

    def eta_s(self, status: ManagerStatus) -> float | None:
        """Seconds until the images should be done, or None before any request has timed the device."""
        device = _device(status)
        typical = device.get("median_s")
        if not isinstance(typical, int | float):
            return None
        shapes = device.get("shape_s") or {}
        waiting, seconds = self.position(status), 0.0
        current = device.get("current")
        if waiting and isinstance(current, dict):  # the request on the device: what its run has left
            run = run_s(shapes, current["resolution"], current["steps"], typical)
            seconds += max(run - current["elapsed_s"], run / max(1, current["steps"]))
            waiting -= 1
        rounds = math.ceil(waiting / self.lanes)  # the requests waiting ahead, `lanes` at a time
        seconds += rounds * typical + self.images * run_s(shapes, self.resolution, self.steps, typical)
        shape = status.shapes.get(self.resolution or "")
        if shape is not None and shape.state is not ShapeState.READY and shape.estimate_s is not None:
            seconds += shape.estimate_s  # its compile or graph load comes first
        return round(seconds, 1)

    def figures(self, status: ManagerStatus) -> dict[str, Any]:
        """`queue_position` and `queue_eta_s` (None when unknown), as a job's view and a stream's comments say."""
        return {"queue_position": self.position(status), "queue_eta_s": self.eta_s(status)}

    def headers(self, status: ManagerStatus) -> dict[str, str]:
        """`X-Queue-Position` and `X-Queue-Eta-Seconds` (left out while there is no ETA)."""
        figures = self.figures(status)
        headers = {"X-Queue-Position": str(figures["queue_position"])}
        if figures["queue_eta_s"] is not None:
            headers["X-Queue-Eta-Seconds"] = str(figures["queue_eta_s"])
        return headers


def _pixels(shape: str) -> int:
    width, _, height = shape.partition("x")
    return int(width) * int(height) if width.isdigit() and height.isdigit() else 0


def run_s(shapes: dict[str, Any], shape: str | None, steps: int | None, typical: float) -> float:
    """Seconds of one image at `shape` with `steps`, from the last runs per shape (`shape_s`); `typical` (the
    median device time of the last requests) when steps are unknown or nothing was timed per shape."""
    if not shapes or not steps or not shape:
        return typical
    timed = shapes.get(shape)
    if timed is not None:
        same = timed["by_steps"].get(str(steps))
        return same if same is not None else timed["per_step_s"] * steps
    pixels = _pixels(shape)
    if not pixels:
        return typical
    near = min(shapes, key=lambda known: abs(_pixels(known) - pixels))  # a shape never run: scaled by pixels
    return shapes[near]["per_step_s"] * steps * pixels / max(1, _pixels(near))


class JobPlaces:
    """Queued jobs' places by job id (web/jobs/jobs.py keeps none), until a view shows the job on the device."""

    def __init__(self) -> None:
        self._places: dict[str, QueuePlace] = {}

    def keep(self, job_id: str, place: QueuePlace) -> None:
        """A new job's place; the oldest are forgotten beyond KEPT_PLACES (jobs never read again)."""
        self._places[job_id] = place
        while len(self._places) > KEPT_PLACES:
            self._places.pop(next(iter(self._places)))

    def waiting(self, view: dict[str, Any]) -> QueuePlace | None:
        """The place of a job that has not reached the device yet (queued, or its worker waits for the lane)."""
        phase = (view.get("progress") or {}).get("phase")
        if view["status"] == "queued" or phase in ("starting", "loading"):
            return self._places.get(view["id"])
        self._places.pop(view["id"], None)
        return None
