"""Asynchronous jobs of the OpenAI-compatible API: `Prefer: respond-async`, `GET`/`DELETE /v1/images/jobs/{id}`.

A cold shape on Neuron compiles for minutes, longer than proxies keep a request open (an AWS ALB cuts idle ones
after 60 s). A job answers 202 at once and is polled, or announces its end to a signed webhook (web/jobs/webhooks.py).
A job is the synchronous request taken apart at the point where it would start device work: validated, charged to
its key and counted in the shared queue at submit (a bad request is a 400 then, never a failed job), and run
by a worker through the same `run_many` as a synchronous request, so it meets the same device lock and limits.

Jobs live in SQLite in the cache folder (`jobs.sqlite3`): a finished job reads the same after a restart until
`job_ttl_s`; a job that a restart cut off is marked failed ("the server restarted"), never lost. A `b64_json`
job's PNGs are files under `cache_dir/job-images/<id>/` (base64 only when read: the database stays small; outside
what Gradio's file route serves, so only the job's key reads them); `url` jobs keep
the URLs the synchronous API hands out. Progress lives in memory: only a running job has any. The table, its
caps and its pruning are web/jobs/job_store.py's.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import queue
import secrets
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool

from neuron_app import tracing
from neuron_app.engine.contract import Manager
from neuron_app.engine.output.images import write_png
from neuron_app.engine.records import GenerationRecord, ProgressCallback, ProgressEvent
from neuron_app.errors import Cancelled, Conflict, NotFound, RequestError
from neuron_app.settings import Settings
from neuron_app.web.jobs.job_store import Caps, JobStore
from neuron_app.web.jobs.live_job import (
    CANCEL_POLL_S,
    CANCEL_WAIT_S,
    ENDED,
    JOB_ID,
    Live,
    _cancelled,
    _estimate_of,
    _int,
    _iso,
    spent,
    stepped,
    wants_async,
)
from neuron_app.web.jobs.sqlite_file import hold
from neuron_app.web.jobs.usage_book import UsageBook
from neuron_app.web.jobs.webhook_pool import QUEUE_FULL, Deliveries
from neuron_app.web.jobs.webhooks import Allowlist

if TYPE_CHECKING:
    from neuron_app.engine.trust.marks import Marker

log = logging.getLogger(__name__)


class Jobs:
    """The job store, its workers (one per device lane) and the job views; web/openai/routes.py hooks it in."""

    def __init__(
        self,
        settings: Settings,
        manager: Manager,
        marker: Marker | None,
        save_url: Callable[[GenerationRecord], str],
        error_of: Callable[[BaseException], dict[str, Any]],
    ) -> None:
        self.settings, self.manager, self.marker = settings, manager, marker
        self.save_url, self.error_of = save_url, error_of
        self.allow = Allowlist(settings.webhook_hosts)
        self.deliveries = Deliveries(
            self.allow,
            workers=settings.webhook_workers,
            max_pending=settings.webhook_queue,
            deadline_s=settings.webhook_timeout_s,
        )
        state = settings.state_folder  # this process's own (web/jobs/sqlite_file.py `hold`)
        self._held = hold(state)
        self.files = state / "job-images"  # not under outputs_dir: Gradio serves that folder
        caps = Caps(
            settings.jobs_per_key, settings.jobs_stored_per_key, settings.job_images_max, settings.job_images_max_bytes
        )
        self.store = JobStore(state / "jobs.sqlite3", self.files, settings.job_ttl_s, caps)
        self.usage = UsageBook(state / "usage.sqlite3")
        self.store.start_pruning()  # TTL and image caps, on its own thread: never on a submit or the event loop
        self._lock = threading.Lock()
        self._live: dict[str, Live] = {}
        self._pending: queue.Queue[str] = queue.Queue()
        self._workers: list[threading.Thread] = []
        for row in self.store.mark_restarted():
            log.warning("job %s was cut off by a restart: marked failed", row["id"])
            self._announce(row["id"])

    # --- submit -------------------------------------------------------------------------------------------
    def check_webhook(self, prefer: str, fields: dict[str, Any]) -> str | None:
        """The job's webhook URL, checked (allowlist, every resolved address); RequestError with param webhook_url."""
        url = fields.get("webhook_url")
        if url is None:
            return None
        if not wants_async(prefer):
            raise RequestError(
                "webhook_url needs an asynchronous job: send the header 'Prefer: respond-async'",
                param="webhook_url",
                code="invalid_webhook_url",
            )
        self.allow.check(url)
        return url

    def submit(
        self,
        key_name: str | None,
        work: Callable[[ProgressCallback], list[GenerationRecord]],
        stack: contextlib.ExitStack,
        *,
        size: str,
        count: int,
        response_format: str,
        webhook_url: str | None,
        url_for: Callable[[str], str],
        echo: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Queue a validated request whose charge and queue place `stack` holds; returns the job's 202 view.
        Over its key's job caps: RateLimited `jobs_full`, with the charge and the queue place given back. `echo`:
        what its answer says was used (quality, background, ...: web/openai/protocol.py), and for whom."""
        job_id = "imgjob_" + secrets.token_urlsafe(18)
        row = {
            "id": job_id,
            "key_name": key_name,
            "status": "queued",
            "created": time.time(),
            "size": size,
            "response_format": response_format,
            "count": count,
            "webhook_url": webhook_url,
        }
        try:
            self.store.insert(row)
        except BaseException:
            stack.__exit__(*sys.exc_info())  # left with the error: the key's images are given back
            raise
        with self._lock:
            self._live[job_id] = Live(job_id, work, stack, url_for, key_name=key_name, echo=echo or {})
            self._start_workers()
        self._pending.put(job_id)
        log.info("job %s queued (%s x%d)", job_id, size, count)
        return self.view(job_id, key_name)

    def _start_workers(self) -> None:
        # One worker per device lane: a job waiting for the device stays queued (cancelled at once by DELETE), so a
        # job's host work (engine/output/postprocess.py) still holds its worker until it ends.
        while len(self._workers) < self.settings.device_lanes:
            worker = threading.Thread(target=self._work, name=f"image-job-{len(self._workers)}", daemon=True)
            self._workers.append(worker)
            worker.start()

    # --- run --------------------------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            job_id = self._pending.get()
            with self._lock:
                live = self._live.get(job_id)
                if live is None or live.state != "queued":
                    continue  # cancelled while it waited
                live.state, live.since = "running", time.monotonic()
                live.waited_s = live.since - live.queued_at
                live.started = live.since
            try:
                self.store.update(job_id, status="running", started=time.time())
                with tracing.resumed(live.trace), tracing.span("job", job_id=job_id):
                    self._run(live)
            except Exception:  # the store itself failed (disk full): logged, and the worker lives on
                log.exception("job %s could not be recorded", job_id)

    def _run(self, live: Live) -> None:
        stopped: Cancelled | None = None
        records: list[GenerationRecord] = []
        try:
            with live.stack:  # leaving it gives the key's images back on failure and frees the queue place
                try:
                    records = live.work(lambda event: self._progress(live, event))
                except Cancelled as exc:
                    if not stepped(live):
                        raise  # before its first step: its images given back
                    stopped = exc  # after steps had run they stay charged (issue 45, row 32)
                items = [self._item(live, record, i) for i, record in enumerate(records)]
        except Cancelled as exc:  # at the next step: nothing was stored
            stopped = exc
        except Exception as exc:
            error = self.error_of(exc)
            log.info("job %s failed: %s", live.id, error["message"])
            self.store.update(live.id, status="failed", error=json.dumps(error), finished=time.time())
        else:
            if stopped is None:
                self._succeeded(live, records, items)
        if stopped is not None:
            log.info("job %s %s", live.id, stopped)
            error = json.dumps(self.error_of(stopped))  # says at which step it stopped
            self.store.update(live.id, status="cancelled", error=error, finished=time.time())
            if stepped(live):  # the device time it took is booked: usage shows what a key used
                self.usage.add(live.key_name, spent(live), 0)
        with self._lock:
            self._live.pop(live.id, None)
        live.ended.set()
        self._announce(live.id)

    def _succeeded(self, live: Live, records: list[GenerationRecord], items: list[dict[str, Any]]) -> None:
        result = live.echo | {"data": items, "size": records[0].resized_to or records[0].resolution}
        result["output_format"] = "png"
        user = live.echo.get("safety_identifier")
        result["usage"] = self.usage.charge(live.key_name, records, live.waited_s, user=user)
        stored = [f.stat().st_size for f in (self.files / live.id).glob("*.png")]
        self.store.update(
            live.id, status="succeeded", result=json.dumps(result), finished=time.time(),
            images=len(stored), bytes=sum(stored),
        )  # fmt: skip
        if stored:
            self.store.wake()  # the pruner checks the image caps now
        log.info("job %s succeeded (%d image(s))", live.id, len(items))

    def _progress(self, live: Live, event: ProgressEvent) -> None:
        """The manager's progress event for this job (the page's own): its phase, and the estimate when compiling.
        After a DELETE, the next step's event stops the job there (engine/steps.py)."""
        if live.stop.is_set() and event.phase in ("denoising", "decoding"):
            raise Cancelled("the job was cancelled")
        if event.phase == "denoising" and event.step > 0:
            live.steps_run += 1
        current = live.event
        if current is None or (event.phase, event.resolution) != (current.phase, current.resolution):
            estimate = live.estimate
            if event.phase == "compiling":  # read once per compile, as the page does (web/page/live.py)
                estimate = _estimate_of(self.manager.status().shapes.get(event.resolution or ""))
            with self._lock:
                live.since, live.estimate = time.monotonic(), estimate
        with self._lock:
            live.event = event

    def _item(self, live: Live, record: GenerationRecord, index: int) -> dict[str, Any]:
        """One image as the synchronous answer has it; a b64_json image becomes a file, read back on GET."""
        item: dict[str, Any] = {"revised_prompt": None}
        row = self.store.get(live.id) or {}
        if row.get("response_format") == "url":
            item["url"] = live.url_for(self.save_url(record))
        else:
            folder = self.files / live.id
            folder.mkdir(parents=True, exist_ok=True)
            write_png(record, folder / f"{index}.png", self.marker)
            item["file"] = f"{index}.png"
        item["provenance"] = record.info()
        return item

    # --- read and cancel ------------------------------------------------------------------------------------
    def _row(self, job_id: str, key_name: str | None) -> dict[str, Any]:
        """The caller's job; another key's job is as unknown as a missing one."""
        row = self.store.get(job_id) if JOB_ID.fullmatch(job_id) else None
        if row is None or (self.settings_keys() and row["key_name"] != key_name):
            raise NotFound(f"no job {job_id!r} (or it expired)", code="job_not_found")
        return row

    def settings_keys(self) -> bool:
        """Named keys exist: a job is visible only to the key that made it."""
        return self.settings.api_key is not None or bool(self.settings.api_keys)

    def view(self, job_id: str, key_name: str | None, *, images: bool = True) -> dict[str, Any]:
        """The job as GET answers it: queued | running (progress) | succeeded (data) | failed (error) | cancelled."""
        row = self._row(job_id, key_name)
        answer: dict[str, Any] = {
            "id": row["id"],
            "object": "image.job",
            "status": row["status"],
            "created": int(row["created"]),
            "started_at": _int(row["started"]),
            "finished_at": _int(row["finished"]),
            "size": row["size"],
            "n": row["count"],
        }
        with self._lock:
            live = self._live.get(job_id)
            if live is not None and row["status"] == "running":
                answer["progress"] = self._progress_view(live)
            elif live is not None and row["status"] == "queued":
                answer["queue_position"] = self._queued_before(job_id)
        if row["result"]:
            result = json.loads(row["result"])
            answer |= result | {"data": [self._image(job_id, item, images) for item in result["data"]]}
        if row["error"]:
            answer["error"] = json.loads(row["error"])
        if row["webhook_url"]:
            answer["webhook"] = {"url": row["webhook_url"]} | json.loads(row["webhook"] or '{"delivered": false}')
        return answer

    def _image(self, job_id: str, item: dict[str, Any], images: bool) -> dict[str, Any]:
        name = item.pop("file", None)
        if name is not None and images:
            with contextlib.suppress(OSError):
                item["b64_json"] = base64.b64encode((self.files / job_id / name).read_bytes()).decode("ascii")
        return item

    def _progress_view(self, live: Live) -> dict[str, Any]:
        event = live.event
        view: dict[str, Any] = {"elapsed_s": round(time.monotonic() - live.since, 1)}
        if event is None:  # running, before the manager's first event: the device lane is being taken
            view |= {"phase": "starting", "message": "started: taking the device, then the steps"}
        else:
            view |= {"phase": event.phase, "resolution": event.resolution, "message": event.message}
            if event.total:
                view |= {"step": event.step, "total": event.total}
            if event.phase == "compiling":
                view["estimate"] = live.estimate
        return view

    def _queued_before(self, job_id: str) -> int:
        """Jobs of this process queued ahead of this one (synchronous requests not counted)."""
        ahead = [j for j, live in self._live.items() if live.state == "queued"]
        return ahead.index(job_id) if job_id in ahead else 0

    def cancel(self, job_id: str, key_name: str | None) -> dict[str, Any]:
        """Cancel a job, never waiting (issue 45: a wait here held a request thread for as long as a compile).
        Queued: its charge given back, its queue place freed. Running: asked to stop at its next denoising step
        (its images never stored, every graph kept) and answered as it reads now, with `cancel_requested`;
        `stopped` awaits the end on the event loop. An ended job answers as it is."""
        row = self._row(job_id, key_name)
        with self._lock:
            live = self._live.get(job_id)
            running = live is not None and live.state == "running"
            if running:
                live.stop.set()
            elif live is not None:
                live.state = "cancelled"
                self._live.pop(job_id)
        if running:
            return self.view(job_id, key_name, images=False) | {"cancel_requested": True}
        if live is None:
            if row["status"] in ENDED:
                return self.view(job_id, key_name, images=False)
            raise Conflict("the job is starting and cannot be cancelled", code="job_running")
        with contextlib.suppress(Exception):
            live.stack.__exit__(*_cancelled())  # the key's images given back
        self.store.update(job_id, status="cancelled", finished=time.time())
        log.info("job %s cancelled", job_id)
        self._announce(job_id)
        return self.view(job_id, key_name, images=False)

    async def stopped(self, job_id: str, key_name: str | None, answer: dict[str, Any]) -> dict[str, Any]:
        """After `cancel` on a running job: wait for its end on the event loop (no thread held), up to
        CANCEL_WAIT_S; then the job as it reads (`answer` if it is still in a phase without steps)."""
        with self._lock:
            live = self._live.get(job_id)
        deadline = time.monotonic() + CANCEL_WAIT_S
        while live is not None and not live.ended.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(CANCEL_POLL_S)
        if live is not None and not live.ended.is_set():
            log.info("job %s: cancel asked, still without a step after %.0f s", job_id, CANCEL_WAIT_S)
            return answer
        return await run_in_threadpool(self.view, job_id, key_name, images=False)

    # --- webhooks ---------------------------------------------------------------------------------------------
    def _announce(self, job_id: str) -> None:
        """Queue the job's end for its webhook (if it has one) in the bounded delivery pool: retries never hold
        a lane, and a slow receiver holds a worker for one attempt's deadline at most."""
        row = self.store.get(job_id)
        if row is None or not row["webhook_url"] or self.settings.webhook_secret is None:
            return
        view = self.view(job_id, row["key_name"], images=False)  # URLs and provenance, never the image bytes
        body = json.dumps(
            {"type": f"image.job.{row['status']}", "timestamp": _iso(time.time()), "data": view},
            separators=(",", ":"),
        ).encode()
        secret = self.settings.webhook_secret.get_secret_value()

        def done(record: dict[str, Any]) -> None:
            self.store.update(job_id, webhook=json.dumps(record))

        if not self.deliveries.submit(row["webhook_url"], secret, f"msg_{job_id}", body, done):
            done({"delivered": False, "attempts": 0, "status": None, "last_error": QUEUE_FULL})

    def close(self) -> None:
        self.deliveries.close()
        self.store.close()
        self.usage.close()
        self._held.close()
