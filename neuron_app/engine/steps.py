"""A request's step events: progress to its caller after every denoising step, and the caller's cancel there.

A caller cancels by raising `Cancelled` from its progress callback (a job's DELETE, the page's Stop): the pipeline
call ends at that step's end, between two graph calls, so no graph is cut mid-run and the next request reuses
every compiled graph. With tensor parallel every rank must finish the call together, so there the cancel is kept
and raised once the call has ended (the image is dropped).
"""

from __future__ import annotations

from typing import Any

from neuron_app.engine.modes.previews import PreviewEvent
from neuron_app.engine.records import ProgressCallback, ProgressEvent
from neuron_app.errors import Cancelled


class StepEvents:
    """`on_step(step, total, preview)` for one pipeline call of a request at `resolution`."""

    def __init__(self, progress: ProgressCallback | None, resolution: str, *, previews: bool, lockstep: bool) -> None:
        self.progress = progress
        self.resolution = resolution
        self.previews = previews  # False while the safety checker is on: no picture of an unchecked image
        self.lockstep = lockstep
        self.cancelled: Cancelled | None = None  # a cancel kept until the tensor-parallel call ends
        self.last_step = 0

    def __call__(self, step: int, total: int, preview: Any = None) -> None:
        self.last_step = step
        if not self.progress or self.cancelled is not None:
            return
        fields = ("denoising", self.resolution, step, total, f"Step {step}/{total}")
        try:
            shown = preview is not None and self.previews
            self.progress(PreviewEvent(*fields, preview=preview) if shown else ProgressEvent(*fields))
            if step == total:
                self.progress(ProgressEvent("decoding", self.resolution, step, total, "Decoding"))
        except Cancelled as exc:
            if not self.lockstep:
                raise Cancelled(f"cancelled at step {step} of {total}", code="cancelled") from exc
            self.cancelled = exc

    def raise_kept(self) -> None:
        """After the call: the cancel a tensor-parallel call had to finish first."""
        if self.cancelled is not None:
            raise Cancelled(f"cancelled at step {self.last_step} (after the tensor-parallel call)", code="cancelled")
