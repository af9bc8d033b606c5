"""MCP progress notifications per denoising step, when the client sends a progressToken (in the request's `_meta`).

Gradio 6.31 forwards each queue update as a notification whose `progress` is a running count of updates, with no
`total`: a client cannot draw a bar. Here a denoising step is `progress = step, total = steps` ("step 2 of 4"); the
other updates (queue place, compile, decode) keep their message and advance `progress` by a sliver that never
reaches the next step, because the MCP specification wants `progress` to increase with every notification.
Without a progressToken Gradio's fast path runs and no notification is sent, as MCP says.

Gradio samples a running event's progress every 10 ms and sends only the latest (`start_progress_updates` in
gradio/queueing.py): steps shorter than that (the tiny test models) can be merged into the next one; a step of a
real model on a device (a tenth of a second and more) is one notification each.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: The share of the distance to the next whole step that an update without a step advances `progress` by.
SLIVER = 0.01


@dataclass
class Note:
    progress: float
    total: float | None
    message: str | None


class StepProgress:
    """Queue and progress updates -> strictly increasing (progress, total) notes."""

    def __init__(self) -> None:
        self.last = 0.0
        self.sent = False

    def note(self, unit: Any, message: str | None) -> Note | None:
        """The note for one update (`unit`: its first progress unit, or None), or None when it would not advance."""
        index, length = getattr(unit, "index", None), getattr(unit, "length", None)
        if index is not None and length:
            value, total = float(index), float(length)
        else:
            value, total = self.last + SLIVER * (math.floor(self.last) + 1 - self.last), None
        if self.sent and value <= self.last:
            return None
        self.last, self.sent = value, True
        return Note(value, total, message)


def mend_progress(server: Any) -> None:
    """Gradio's streaming tool path, sending step progress with a total (see the module docstring)."""
    original = getattr(server, "_execute_tool_with_progress", None)
    format_message = getattr(server, "_format_progress_message", None)
    if original is None or format_message is None or getattr(original, "_mended", False):
        log.warning("Gradio's MCP server changed: progress notifications are Gradio's own (no step totals)")
        return

    async def execute(job: Any, progress_token: str | int) -> Any:
        context = server.mcp_server.request_context
        steps, output = StepProgress(), None
        async for update in job:
            if update.type == "status":
                units = update.progress_data or []
                unit = units[0] if units else None
                note = steps.note(unit, format_message(update) or getattr(unit, "desc", None))
                if note is not None:
                    await context.session.send_progress_notification(
                        progress_token=progress_token,
                        progress=note.progress,
                        total=note.total,
                        message=note.message,
                        related_request_id=str(context.request_id),
                    )
            elif update.type == "output" and update.final:
                output = update.outputs
                if not update.success:  # Gradio's own wording of a failed event
                    title, error = output.get("title"), output.get("error")
                    raise RuntimeError(": ".join(part for part in (title, error) if part) or "Error!")
        if job.exception():
            raise job.exception()
        return output["data"]

    execute._mended = True  # type: ignore[attr-defined]
    server._execute_tool_with_progress = execute
