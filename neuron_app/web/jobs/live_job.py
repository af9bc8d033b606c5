"""A job's parts that need no job store: its id form, its in-memory state (`Live`), and small helpers of the
views and webhooks (web/jobs/jobs.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from neuron_app import tracing
from neuron_app.engine.records import GenerationRecord, ProgressCallback, ProgressEvent, Usage

JOB_ID = re.compile(r"imgjob_[A-Za-z0-9_-]{24}")
ENDED = ("succeeded", "failed", "cancelled")
#: How long a DELETE on a running job waits for it to stop at its next step (a step is well under this).
CANCEL_WAIT_S = 30.0
#: How often a waiting DELETE looks whether its job ended (on the event loop: a few checks of a flag a second).
CANCEL_POLL_S = 0.1


def wants_async(prefer: str) -> bool:
    """RFC 7240: `Prefer: respond-async` (among other preferences, any case)."""
    return any(part.split(";")[0].strip().lower() == "respond-async" for part in prefer.split(","))


@dataclasses.dataclass
class Live:
    """A job of this process that has not ended: what runs it, and its progress (memory only)."""

    id: str
    work: Callable[[ProgressCallback], list[GenerationRecord]]
    stack: contextlib.ExitStack  # its key's charge and its place in the shared queue, released when it ends
    url_for: Callable[[str], str]
    state: str = "queued"
    event: ProgressEvent | None = None
    since: float = 0.0  # when the current phase began (monotonic)
    estimate: dict[str, Any] | None = None  # the shape's compile (or load) estimate when it started compiling
    key_name: str | None = None  # whose usage it is
    echo: dict[str, Any] = dataclasses.field(default_factory=dict)  # what its answer says was used, and for whom
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)  # DELETE while it runs
    ended: threading.Event = dataclasses.field(default_factory=threading.Event)
    queued_at: float = dataclasses.field(default_factory=time.monotonic)
    waited_s: float = 0.0  # queued, until a worker took it
    started: float = 0.0  # when a worker took it (monotonic)
    steps_run: int = 0  # denoising steps it reached (a cancel after the first one is booked, not refunded)
    trace: Any = dataclasses.field(default_factory=tracing.capture)  # the submitting request's trace


def _estimate_of(shape: Any) -> dict[str, Any] | None:
    """The shape's estimate as the status table has it: seconds, load or compile, and how sure."""
    if shape is None or shape.estimate_s is None:
        return None
    found = shape.estimate
    if found is None:
        return {"seconds": round(shape.estimate_s, 1)}
    return {"seconds": round(found.seconds, 1), "kind": found.kind, "basis": found.basis, "sure": found.sure}


def _cancelled() -> tuple[Any, BaseException, Any]:
    try:
        raise RuntimeError("the job was cancelled")
    except RuntimeError:
        info = sys.exc_info()
    return info  # type: ignore[return-value]


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def _iso(stamp: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(stamp))


def stepped(live: Live) -> bool:
    """The job reached a denoising step: the device worked for it."""
    return live.steps_run > 0


def spent(live: Live) -> Usage:
    """What a job cancelled after its first step took from the device, as the usage book counts it: its seconds
    since a worker took it, its steps, no image."""
    return cancelled_usage(live.started, live.steps_run, live.waited_s)


def cancelled_usage(started: float, steps: int, waited_s: float = 0.0) -> Usage:
    """A run cancelled after its first step (a job, or a stream whose client went away): the seconds since it took
    the device (`started`, monotonic), its steps, no image. Booked so that cutting a run short is no way around
    a key's usage (issue 45 row 32, issue 52 row 15)."""
    seconds = round(time.monotonic() - started, 4)
    return Usage(
        queue_s=round(waited_s, 4), compile_s=0.0, inference_s=seconds, steps=steps,
        output_megapixels=0.0, input_megapixels=0.0, cache="-", eager_compiles=0, device_seconds=seconds,
    )  # fmt: skip
