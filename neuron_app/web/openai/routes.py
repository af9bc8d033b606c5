"""An OpenAI-compatible Images API on the page's server: `POST /v1/images/generations`, `/v1/images/edits`.

Scripts, the `openai` SDKs, LangChain tools and Open WebUI speak this API. The routes are added like
`/healthz` (see web/ops.py), so they live on the same port and behind the share link. They add no
second path to the device: a request is validated once by the manager's `validate` (engine/requests.py),
and its images go through the manager's `run` (in a worker thread), which waits on the same device lock as
the page and reports to /metrics and the shape hits. Several images (`n`) are runs with consecutive seeds.

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and the status codes its
clients expect: 400 invalid request, 401 key missing or wrong, 404 unknown file, 413 body too large,
429 queue full, 501 editing unavailable, 503 loading or shutting down, 500 a failure on the server.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from neuron_app import tracing
from neuron_app.engine.contract import Manager
from neuron_app.engine.modes.sizing import fit_record
from neuron_app.engine.output.images import encoded
from neuron_app.engine.records import GenerationRecord, ProgressEvent
from neuron_app.engine.requests import AUTO_SIZE, MAX_SEED, check_images, resolve_size
from neuron_app.engine.trust.marks import MIME, Marker
from neuron_app.errors import AppError, RequestError, ShuttingDown
from neuron_app.settings import Settings
from neuron_app.web.access import Access
from neuron_app.web.jobs.jobs import Jobs, wants_async
from neuron_app.web.multi_image import offered_shapes, run_many, validate_many
from neuron_app.web.openai import openapi, protocol, sizes
from neuron_app.web.openai.errors import ApiError, failure, read_body, refusal
from neuron_app.web.openai.forms import content_type, image_options, read_edit_form
from neuron_app.web.openai.image_urls import UrlStore
from neuron_app.web.openai.protocol import PNG, ImageEditRequest, ImageRequest, Output, check_size
from neuron_app.web.openai.streaming import ImageStream
from neuron_app.web.ops import gradio_queue_length
from neuron_app.web.queue_place import JobPlaces, QueuePlace
from neuron_app.web.traced import traced

log = logging.getLogger(__name__)

OPENAI_PATHS = (
    "/v1/models",
    "/v1/images/generations",
    "/v1/images/edits",
    "/v1/images/files/{name}",
    "/v1/images/jobs/{id}",
    "/v1/openapi.json",
)
#: A JSON request is a prompt and a few numbers; edits carry reference images.
GENERATION_BODY_LIMIT = 1 << 20
#: Extensions beyond OpenAI's parameters, passed to `generate` when present (#15: LoRA style and strength;
#: `loras`: several styles, [{"name", "scale"}], #32).
EXTENSIONS = ("lora", "lora_scale", "loras")


class OpenAIImages:
    """The API of one app; `routes()` go to Ops (and from there to `launch(app_kwargs=...)`)."""

    def __init__(self, settings: Settings, manager: Manager, demo: Any = None, access: Access | None = None) -> None:
        self.settings = settings
        self.manager = manager
        self.demo = demo
        self.access = access or Access(settings)  # keys, limits and their counts (web/access.py)
        self.marker = Marker.for_settings(settings)  # watermark, IPTC, C2PA (engine/trust/marks.py)
        # Outside outputs_dir (which Gradio serves at /gradio_api/file= to anyone): only /v1/images/files/ serves
        # these, by an unguessable name that expires (a capability URL).
        self.urls = UrlStore(settings.cache_dir / "api-images", settings.image_url_ttl_s, self.marker)
        self._lock = threading.Lock()
        self._in_flight = 0
        # Prefer: respond-async (web/jobs/jobs.py): the same checks, charge and queue place, run by a job worker.
        self.jobs = Jobs(settings, manager, self.marker, self.urls.save, lambda exc: failure(exc).body())
        self.usage = self.jobs.usage  # usage per key per day (web/jobs/usage_book.py): /metrics and `neuron_app usage`
        self.places = JobPlaces()  # a queued job's place in the device queue (web/queue_place.py)

    @property
    def in_flight(self) -> int:
        """API requests admitted and not answered (they wait for the device outside Gradio's queue)."""
        return self._in_flight

    @property
    def editing(self) -> bool:
        """Whether the manager takes reference images (editing is not switched off with `max_references = 0`)."""
        return self.manager.supports_editing

    # --- checks, in the order a request meets them --------------------------------------------------
    def check_auth(self, request: Request) -> str | None:
        """The name of the caller's key (also kept as `request.state.api_key_name`), or None when no key is
        configured; 401 for a missing or wrong key, and while the page needs a login and no key is set."""
        request.state.api_key_name = None
        if not self.access.keys_required:
            if self.settings.auth is not None:  # the page is protected: never serve the API unauthenticated
                raise ApiError(
                    401,
                    "this server's page needs a login and no API key is configured: set NEURON_APP_API_KEY (or "
                    "NEURON_APP_API_KEYS) on the server and send it as 'Authorization: Bearer <key>'",
                    code="api_key_required",
                )
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        name = self.access.identify(token.strip())  # every key compared, in constant time
        if scheme.lower() != "bearer" or name is None:
            raise ApiError(
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        request.state.api_key_name = name
        return name

    @contextlib.contextmanager
    def admitted(self) -> Iterator[QueuePlace]:
        """503 while loading or shutting down, 429 when the shared queue is full; counts this request in, and
        yields its place in the queue: the requests ahead of it are those this check counts."""
        if self.manager.draining:
            raise refusal(ShuttingDown("the server is shutting down; try again in a moment"))
        status = self.manager.status()
        if status.loading:
            raise ApiError(
                503,
                "the model is loading; try again in a moment",
                type="server_error",
                code="loading",
                headers={"Retry-After": "10"},
            )
        with self._lock:
            gradio = gradio_queue_length(self.demo) if self.demo is not None else None
            waiting = self.manager.in_flight if gradio is None else gradio + self._in_flight
            past_device = (status.stages.get("post") or {}).get("running", 0)  # in a post slot: not waiting
            if waiting - past_device >= self.settings.queue_max_size + self.settings.device_lanes:
                raise ApiError(
                    429,
                    f"the queue is full ({waiting} requests waiting or running); try again in a moment",
                    type="rate_limit_error",
                    code="queue_full",
                    headers={"Retry-After": "5"},
                )
            self._in_flight += 1
        try:
            yield QueuePlace.taken(status, waiting - past_device, self.settings.device_lanes)
        finally:
            with self._lock:
                self._in_flight -= 1

    # --- the shared path of generations and edits ---------------------------------------------------
    async def serve(
        self,
        request: Request,
        asked: ImageRequest,
        held: tuple[contextlib.ExitStack, QueuePlace] | None = None,
        **options: Any,
    ) -> Response:
        """A request the protocol parsed (web/openai/protocol.py), handed to the engine's one validation. `held`:
        the queue place an edit took before its body (its stack, taken over here, and the place)."""
        options |= {name: getattr(asked, name) for name in EXTENSIONS if getattr(asked, name) is not None}
        asked.check_model(self.settings.model)
        response_format = asked.response_format or "b64_json"
        heavy = isinstance(asked, ImageEditRequest)  # an edit's images: read after the key and the queue place
        try:
            moderation = asked.moderation_used(bool(self.settings.safety_on or self.settings.blocked_terms
                                                    or self.settings.blocked_terms_file))  # fmt: skip
            count = check_images(1 if asked.n is None else asked.n, self.settings.max_images)
            offered = offered_shapes(self.manager.status())
            if not heavy:
                size = resolve_size(asked.size, self.settings.default_resolution, offered)
            else:  # an edit: "auto" follows the first reference's aspect ratio (engine/requests.py)
                size = asked.size or AUTO_SIZE
            shape = asked.model_dump(include={"size", "aspect_ratio", "output_megapixels"})
            size_plan = sizes.plan_for(self.settings, shape, offered, options)  # size_policy = nearest
            size = size_plan.served if size_plan else size
            check_size(size, offered)
            steps = asked.steps(self.settings.default_steps)
            seed = asked.seed
            if seed is None:
                seed = random.randint(0, MAX_SEED - (count - 1))
        except RequestError as exc:
            raise self.refused(exc) from None
        # An edit's images are read (header, then pixels) only after its key, limits and queue place are
        # checked; a text-only request is checked in full first. Both in a worker: never on the event loop.
        check = (self.manager, asked.prompt, size, steps, seed, count)
        if not heavy:
            job, count = await self.validated(*check, **options)
        prefer = request.headers.get("prefer", "")
        if wants_async(prefer):
            asked.check_asynchronous()
        try:  # allowlist and every resolved address: a 400 naming webhook_url, and no connection made
            webhook_url = await run_in_threadpool(self.jobs.check_webhook, prefer, {"webhook_url": asked.webhook_url})
        except RequestError as exc:
            raise refusal(exc) from None

        def on_progress(event: ProgressEvent) -> None:
            log.info("openai api %s: %s", event.resolution or "", event.message)

        with contextlib.ExitStack() as stack:
            try:  # the key's (or the address's) images: 429 over a limit, given back if anything below fails
                client = request.client.host if request.client else None
                stack.enter_context(self.access.api_images(request.state.api_key_name, client, count))
            except AppError as exc:
                log.info("openai api refused: %s", exc)
                raise refusal(exc) from None
            if held is None:
                place = stack.enter_context(self.admitted())
            else:  # taken before the body: this stack lets it go from now on (or hands it to a stream or a job)
                place = held[1]
                stack.enter_context(held[0].pop_all())
            if heavy:  # the pixel budget from each image's header, then the decode (engine/modes/references.py)
                job, count = await self.validated(*check, **options)
            job = dataclasses.replace(job, output=asked.output, previews=bool(asked.partials))  # the post stage's
            place = dataclasses.replace(place, images=count, resolution=str(job.resolution), steps=job.steps)
            echo = asked.echo(size_plan.asked if size_plan else str(job.resolution), job.steps,
                              self.settings.default_steps, moderation)  # fmt: skip
            now = await run_in_threadpool(self.manager.status)
            queue_headers = place.headers(now)
            if asked.partials is not None:  # the worker lets the charge and the queue place go when the run ends
                prefix = "image_edit" if heavy else "image_generation"
                stream = ImageStream(self, request, job, size_plan, place, stack.pop_all(), prefix, asked.partials,
                                     echo)  # fmt: skip
                return stream.response(queue_headers)
            if wants_async(prefer):  # the job holds the charge and the queue place from here until it ends
                try:  # over the key's job caps: a 429 jobs_full, the charge given back
                    view = await run_in_threadpool(
                        self.jobs.submit,
                        request.state.api_key_name,
                        lambda progress: [
                            fit_record(r, size_plan) for r in run_many(self.manager, job, count, progress)
                        ],
                        stack.pop_all(),
                        size=str(job.resolution),
                        count=count,
                        response_format=response_format,
                        webhook_url=webhook_url,
                        url_for=lambda name: str(request.url_for("openai_image_file", name=name)),
                        echo=echo,
                    )
                except AppError as exc:
                    raise refusal(exc) from None
                self.places.keep(view["id"], place)
                view |= place.figures(now)
                headers = queue_headers | {"Location": f"/v1/images/jobs/{view['id']}"}
                return JSONResponse(view, status_code=202, headers=headers)
            try:
                records = await run_in_threadpool(run_many, self.manager, job, count, on_progress)
                records = [fit_record(r, size_plan) for r in records]  # off the loop below, with the marks
            except Exception as exc:
                self.access.observe_error(exc, "openai")
                raise failure(exc) from None
        # Marking and signing take CPU time (a watermark on 1024x1024 ~1 s): off the event loop.
        try:
            data = await run_in_threadpool(self.image_items, request, records, response_format, asked.output)
        except Exception as exc:  # a full disk is a 507 (errors.StorageFull), anything else a one-line 500
            raise failure(exc) from None
        usage = await run_in_threadpool(self.usage.charge, request.state.api_key_name, records, user=asked.identifier)
        fields = echo | {"created": int(time.time()), "data": data, "usage": usage} | sizes.answer_fields(size_plan)
        answer = protocol.answer(protocol.ImagesResponse, **fields)
        return JSONResponse(answer, headers=queue_headers)  # where it stood when admitted (web/queue_place.py)

    def refused(self, exc: RequestError) -> ApiError:
        log.info("openai api refused: %s", exc)
        self.access.observe_error(exc, "openai")
        return refusal(exc)

    async def validated(self, *check: Any, **options: Any) -> Any:
        """`validate_many` in a worker thread (blocked terms, image headers and decodes): nothing ran yet."""
        try:
            return await run_in_threadpool(validate_many, *check, **options)
        except RequestError as exc:
            raise self.refused(exc) from None

    def image_items(
        self, request: Request, records: list[GenerationRecord], response_format: str, output: Output = PNG
    ) -> list[Any]:
        with tracing.span("response", images=len(records), response_format=response_format):
            return [self.image_item(request, r, response_format, output) for r in records]

    def image_item(
        self, request: Request, record: GenerationRecord, response_format: str, output: Output = PNG
    ) -> dict[str, Any]:
        """One image of the answer (the post stage's file, unless resized since); `provenance` (ignored by the
        OpenAI SDK's parsing) says how it was made."""
        item: dict[str, Any] = {"revised_prompt": None}
        if response_format == "url":
            name = self.urls.save(record, output)
            item["url"] = str(request.url_for("openai_image_file", name=name))
        else:
            item["b64_json"] = base64.b64encode(encoded(record, self.marker, *output)).decode("ascii")
        item["provenance"] = record.info()  # after writing: it lists the marks the PNG carries
        return item

    # --- endpoints --------------------------------------------------------------------------------
    async def generations(self, request: Request) -> Response:
        try:
            self.check_auth(request)
            declared = request.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > GENERATION_BODY_LIMIT:
                await read_body(request, GENERATION_BODY_LIMIT)  # raises 413
            if content_type(request) != "application/json":
                raise ApiError(400, "Content-Type must be application/json", code="invalid_content_type")
            body = await read_body(request, GENERATION_BODY_LIMIT)
            return await self.serve(request, protocol.parse_json(body))  # web/openai/protocol.py
        except ApiError as exc:
            return self.answer_error(request, exc)

    async def edits(self, request: Request) -> Response:
        try:
            name = self.check_auth(request)
            try:  # over its limit: the 429 before the body (up to 50 MB) is read and parsed (issue 45, row 39)
                self.access.api_room(name, request.client.host if request.client else None)
            except AppError as exc:
                raise refusal(exc) from None
            # Loading, shutting down or a full queue: refused before the body (issue 52). The place is held from
            # here, while the body arrives, to the run or the refusal: concurrent edit bodies are bounded by the
            # queue, not by the number of addresses (red team turn 7, row 4).
            with contextlib.ExitStack() as held:
                place = held.enter_context(self.admitted())
                edit = await read_edit_form(request)  # web/openai/forms.py: spooled to disk, each file read once
                options = image_options(edit)
                if options.get("references") and not self.editing:
                    unavailable = "image editing is not available on this server"
                    raise ApiError(501, unavailable, type="server_error", code="not_implemented")
                return await self.serve(request, edit, held=(held, place), **options)
        except ApiError as exc:
            return self.answer_error(request, exc)

    def answer_error(self, request: Request, exc: ApiError) -> Response:
        """The error's answer; a refusal of a known key is counted under its name (rate limits count themselves)."""
        name = getattr(request.state, "api_key_name", None)
        if name is not None and exc.status < 500 and exc.code != "rate_limit_exceeded":
            self.access.api_refused(name, exc.code)
        return exc.response()

    async def image_file(self, request: Request) -> Response:
        path = self.urls.find(request.path_params["name"])
        if path is None:
            return ApiError(404, "no such image (or it expired)", code="not_found").response()
        return FileResponse(path, media_type=MIME[path.suffix[1:]])

    async def job(self, request: Request) -> Response:
        """An asynchronous job (web/jobs/jobs.py): GET reads it, DELETE cancels it (queued, or at its next step)."""
        try:
            name = self.check_auth(request)
            if request.method == "DELETE":
                answer = await run_in_threadpool(self.jobs.cancel, request.path_params["id"], name)  # never waits
                if answer.get("cancel_requested"):  # running: its end awaited on the loop, no thread held
                    answer = await self.jobs.stopped(request.path_params["id"], name, answer)
                return JSONResponse(answer)
            view = await run_in_threadpool(self.jobs.view, request.path_params["id"], name)
            if place := self.places.waiting(view):  # until it reaches the device, as the answers' headers say
                view |= place.figures(await run_in_threadpool(self.manager.status))
            return JSONResponse(view)
        except AppError as exc:
            return self.answer_error(request, refusal(exc))
        except ApiError as exc:
            return self.answer_error(request, exc)

    async def models(self, request: Request) -> Response:
        try:
            self.check_auth(request)
        except ApiError as exc:
            return exc.response()
        model = {"id": self.settings.model, "object": "model", "created": 0, "owned_by": "neuron-app"}
        return JSONResponse({"object": "list", "data": [model]})

    def routes(self) -> list[Route]:
        return [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/images/generations", traced(self.generations), methods=["POST"]),  # web/traced.py
            Route("/v1/images/edits", traced(self.edits), methods=["POST"]),
            Route("/v1/images/files/{name}", self.image_file, methods=["GET"], name="openai_image_file"),
            Route("/v1/images/jobs/{id}", self.job, methods=["GET", "DELETE"]),
            Route("/v1/openapi.json", openapi.document_route, methods=["GET"]),
        ]
