"""OpenAI image streaming: `stream=true` (and `partial_images` 0-3) on `/v1/images/generations` and `/edits`.

The answer is server-sent events as OpenAI's SDKs parse them: `image_generation.partial_image` events (edits:
`image_edit.partial_image`), then one `image_generation.completed` (`image_edit.completed`) with the image and
its usage; a failure once the stream has begun is an `error` event whose `error` is OpenAI's error object (the
SDKs raise it as an APIError). Everything that can be refused is refused before the stream begins, with the usual
JSON error and status code (web/openai/routes.py).

Partial images are the page's step previews (engine/modes/previews.py: the latents after a step, projected to RGB
on the host, a quarter of the image's side), taken at steps spread over the run, scaled to the image's size and
marked as the final image is (watermark, IPTC XMP, signed C2PA: engine/trust/marks.py), with a `partial_image`
text chunk saying which step it shows. While the safety checker is on no preview is made (no picture of an
unchecked image leaves), so a stream then has no partial image; OpenAI's clients expect that some may be missing.

The run is the synchronous request's: validated and admitted first, then `run_many` in a worker thread on the same
device lane; the event loop only moves events. While the request waits for the device, comment lines
(`: {"queue_position": 1, "queue_eta_s": 12.5}`, web/queue_place.py) say where it stands: SDKs skip comments,
and they keep proxies from closing a quiet connection during a compile. A client that goes away stops the run at
its next denoising step (engine/steps.py), as the page's Stop does. As a cancelled job is, a stream closed after
its first step stays charged and its device seconds and steps are booked (web/jobs/live_job.py); only one closed
before its first step is given back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import StreamingResponse

from neuron_app import tracing
from neuron_app.engine.modes.previews import PreviewEvent
from neuron_app.engine.modes.sizing import fit_record
from neuron_app.engine.output.images import encoded, provenance
from neuron_app.engine.records import CacheResult, GenerationRecord, ProgressEvent
from neuron_app.errors import Cancelled
from neuron_app.web.jobs.live_job import cancelled_usage
from neuron_app.web.multi_image import run_many
from neuron_app.web.openai.errors import ApiError, failure
from neuron_app.web.openai.protocol import ImageCompletedEvent, ImagePartialEvent, answer
from neuron_app.web.queue_place import QueuePlace

log = logging.getLogger(__name__)

#: How often a waiting stream looks at its queue place and at its client (seconds).
TICK_S = 1.0
#: A comment line at least this often while nothing else is sent (proxies close idle connections).
KEEPALIVE_S = 10.0


def partial_steps(steps: int, partials: int) -> list[int]:
    """The steps whose previews become partial images: spread evenly, the last before the final image (fewer
    when there are fewer steps than partial images)."""
    return sorted({min(steps, math.ceil(i * steps / (partials + 1))) for i in range(1, partials + 1)})


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def comment(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f": {text}\n\n".encode()


@dataclasses.dataclass
class ImageStream:
    """One streamed request: validated, admitted and charged (its `stack` holds the charge and the queue place,
    let go by the worker when the run ends), not yet run."""

    api: Any  # OpenAIImages (web/openai/routes.py)
    request: Request
    job: Any  # the validated engine Request, with its output format
    size_plan: Any
    place: QueuePlace
    stack: contextlib.ExitStack
    prefix: str  # image_generation | image_edit
    partials: int
    echo: dict[str, Any]  # what the events say was used (web/openai/protocol.py: ImageRequest.echo)
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)  # the client went away
    started: float = 0.0  # when it took the device (monotonic), 0 before
    steps_run: int = 0  # denoising steps it reached: a cancel after the first one is charged and booked

    def response(self, headers: dict[str, str]) -> StreamingResponse:
        """The run starts now, in its worker thread (it lets its charge go even if the stream is never read)."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        stop = self.stop
        chosen = set(partial_steps(self.job.steps, self.partials)) if self.partials else set()
        trace = tracing.capture()

        def put(item: tuple[str, Any]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed (shutdown): nobody is listening
                loop.call_soon_threadsafe(inbox.put_nowait, item)

        def on_progress(event: ProgressEvent) -> None:
            if stop.is_set() and event.phase in ("denoising", "decoding"):
                raise Cancelled("the client went away", code="cancelled")
            if event.phase == "denoising" and event.step > 0:
                self.steps_run += 1
            if event.phase != "loading" and not self.started:
                self.started = time.monotonic()
            log.info("openai api stream %s: %s", event.resolution or "", event.message)
            if isinstance(event, PreviewEvent) and event.step in chosen and event.preview is not None:
                put(("preview", event))
            elif event.phase != "loading":
                put(("started", None))

        def target() -> None:
            try:
                with tracing.resumed(trace):
                    put(("done", self.work(on_progress)))
            except BaseException as exc:  # handed to the stream, which sends it as an error event
                put(("error", exc))

        threading.Thread(target=target, name="openai-stream", daemon=True).start()
        headers = headers | {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(self.events(inbox, stop), media_type="text/event-stream", headers=headers)

    # --- in the worker thread -------------------------------------------------------------------------------
    def work(self, on_progress: Callable[[ProgressEvent], None]) -> tuple[GenerationRecord, bytes, dict[str, Any]]:
        """The run, its marked file and its usage; the charge and the queue place are let go when it ends."""
        failed: tuple[Any, Any, Any] = (None, None, None)
        try:
            record = fit_record(run_many(self.api.manager, self.job, 1, on_progress)[0], self.size_plan)
            data = encoded(record, self.api.marker, *self.job.output)  # the post stage's file, unless resized
            usage = self.api.usage.charge(
                self.request.state.api_key_name, [record], user=self.echo.get("safety_identifier")
            )
            return record, data, usage
        except BaseException as exc:
            failed = sys.exc_info()
            if not isinstance(exc, Cancelled):
                self.api.access.observe_error(exc, "openai")
            elif self.steps_run:  # cut after its first step: charged and booked, as a cancelled job is
                failed = (None, None, None)
                self.api.usage.add(self.request.state.api_key_name, cancelled_usage(self.started, self.steps_run), 0)
            raise
        finally:
            self.stack.__exit__(*failed)  # a failure, or a cancel before the first step, gives the images back

    def partial(self, event: PreviewEvent, index: int) -> bytes:
        """A step's preview at the image's size, marked and signed as the final image is."""
        from PIL import Image

        job = self.job
        image = event.preview.resize((job.resolution.width, job.resolution.height), Image.Resampling.BILINEAR)
        record = GenerationRecord(
            resolution=str(job.resolution), steps=job.steps, seed=job.seed, prompt=job.prompt,
            cache=CacheResult.MEMORY, compiled=False, compile_s=0.0, inference_s=0.0, total_s=0.0,
            graphs_compiled=0, model=self.api.settings.model, image=image, lora=job.lora, lora_scale=job.lora_scale,
            loras=[{"name": name, "scale": scale} for name, scale in job.loras],
        )  # fmt: skip
        record = fit_record(record, self.size_plan)
        text = provenance(record) | {"partial_image": f"{index} (step {event.step} of {event.total})"}
        with tracing.span("marks", format=job.output[0], partial=True):
            return self.api.marker.encode(record, text, *job.output)

    # --- on the event loop ----------------------------------------------------------------------------------
    def _common(self, size: str) -> dict[str, Any]:
        return self.echo | {"size": size, "created_at": int(time.time())}

    async def events(self, inbox: asyncio.Queue[tuple[str, Any]], stop: threading.Event) -> AsyncIterator[bytes]:
        """The worker's events as server-sent events; `stop` set when the client goes away."""
        started, index, said, sent = False, 0, None, time.monotonic()
        try:
            while True:
                try:
                    kind, item = await asyncio.wait_for(inbox.get(), TICK_S)
                except TimeoutError:
                    if await self.request.is_disconnected():
                        return
                    figures = None if started else self.place.figures(await run_in_threadpool(self.api.manager.status))
                    if figures is not None and figures != said:
                        said, sent = figures, time.monotonic()
                        yield comment(figures)
                    elif time.monotonic() - sent >= KEEPALIVE_S:
                        sent = time.monotonic()
                        yield comment("keepalive")
                    continue
                sent = time.monotonic()
                if kind == "started":
                    started = True
                elif kind == "preview":
                    try:
                        data = await run_in_threadpool(self.partial, item, index)
                    except Exception as exc:  # a partial image that cannot be marked is never sent
                        yield sse("error", {"type": "error", "error": failure(exc).body()})
                        return
                    event = {"type": f"{self.prefix}.partial_image", "b64_json": _b64(data)}
                    event |= {"partial_image_index": index} | self._common(self._size(str(self.job.resolution)))
                    yield sse(event["type"], answer(ImagePartialEvent, **event))
                    index += 1
                elif kind == "error":
                    error = item if isinstance(item, ApiError) else failure(item)
                    yield sse("error", {"type": "error", "error": error.body()})
                    return
                else:
                    record, data, usage = item
                    event = {"type": f"{self.prefix}.completed", "b64_json": _b64(data), "usage": usage}
                    event |= self._common(record.resized_to or record.resolution) | {"provenance": record.info()}
                    yield sse(event["type"], answer(ImageCompletedEvent, **event))
                    return
        finally:
            stop.set()  # the client went away (or the stream ended): the run stops at its next step

    def _size(self, served: str) -> str:
        return self.size_plan.asked if self.size_plan is not None and self.size_plan.resized else served


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode("ascii")
