"""Operations endpoints on the Gradio server: `/healthz`, `/readyz`, `/metrics`.

Gradio 6's `launch()` has no hook for extra routes, but it passes `app_kwargs` to the
`FastAPI(...)` it builds. Routes given there as `routes=[...]` are registered before all of
Gradio's own, on the same server and port, so the `share` link keeps working (mounting the
Blocks on our own FastAPI app with `gr.mount_gradio_app` would give the share tunnel up).

Gradio's login does not cover these routes. Health and readiness reveal nothing and must stay
open for load balancers and orchestrators; `/metrics` asks for the app's basic-auth
credentials when auth is configured (Prometheus sends them with `basic_auth` in its scrape config).
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Callable, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from neuron_app.engine.contract import Manager
from neuron_app.engine.records import ShapeState
from neuron_app.settings import Settings
from neuron_app.web.metrics import Metrics

OPS_PATHS = ("/healthz", "/readyz", "/metrics")


def gradio_queue_length(demo: Any) -> int | None:
    """Requests waiting plus running in the Gradio queue; None when the queue is not reachable.

    Gradio has no public accessor: `Blocks._queue` (a `gradio.queueing.Queue`) is read defensively.
    """
    queue = getattr(demo, "_queue", None)
    if queue is None:
        return None
    try:
        return len(queue) + queue.get_active_worker_count()
    except Exception:  # a Gradio upgrade changed the internals: no gauge rather than a broken scrape
        return None


class Ops:
    """The operations endpoints of one app; `app_kwargs()` goes to `Blocks.launch(app_kwargs=...)`."""

    def __init__(
        self,
        settings: Settings,
        manager: Manager,
        demo: Any = None,
        extra_routes: Sequence[Route] = (),
        extra_waiting: Callable[[], int] = lambda: 0,
    ) -> None:
        self.settings = settings
        self.manager = manager
        self.demo = demo
        # Other APIs on the same server (web/openai/routes.py): their routes, and their requests outside Gradio's queue.
        self.extra_routes = list(extra_routes)
        self.extra_waiting = extra_waiting
        self.metrics = Metrics(manager, queue_length=self.queue_length)

    def queue_length(self) -> int:
        length = gradio_queue_length(self.demo) if self.demo is not None else None
        return self.manager.in_flight if length is None else length + self.extra_waiting()

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready = the model is loaded and at least one shape is compiled or precompiled (and the TP group is
        whole). A precompiled shape counts: after a restart its first request loads graphs from the cache folder
        (seconds), and a load balancer that waits for a compile in memory would never send that request."""
        status = self.manager.status()
        precompiled = [
            r
            for r, s in status.shapes.items()
            if s.offered and s.manifest == "precompiled" and s.state is not ShapeState.FAILED and r not in status.ready
        ]
        body: dict[str, Any] = {"ready": False, "loaded": status.loaded, "ready_shapes": status.ready}
        body["precompiled_shapes"] = precompiled
        if status.broken:
            body["reason"] = f"tensor-parallel group is broken: {status.broken}"
        elif self.manager.draining:
            body["reason"] = "the server is shutting down"  # load balancers stop sending work
        elif not status.loaded:
            if status.loading:
                body["reason"] = "the model is loading"
            elif status.load_error:
                body["reason"] = f"the model failed to load: {status.load_error}"
            else:
                body["reason"] = "the model is not loaded yet (it loads on the first request, or with load_on_start)"
        elif not status.ready and not precompiled and status.warmup["pending"] and status.warmup["running"]:
            pending = ", ".join(status.warmup["pending"])
            body["reason"] = f"warming up (warmup = {status.warmup['mode']}): compiling {pending}; ready when done"
        elif not status.ready and not precompiled:
            body["reason"] = "no shape is compiled yet (precompile, set warmup, or send a first request)"
        else:
            body["ready"] = True
        if status.replicas:  # Ray Serve: ready once one replica is; the count tells how many serve
            body["replicas"] = len(status.replicas)
            body["ready_replicas"] = sum(1 for r in status.replicas if r["healthy"] and r["ready_shapes"])
        return body["ready"], body

    # --- endpoints -----------------------------------------------------------------------------
    async def healthz(self, request: Request) -> Response:
        """On the event loop: no pool thread needed, so a busy thread pool never delays the liveness probe."""
        return JSONResponse({"status": "alive"})

    def readyz(self, request: Request) -> Response:
        ready, body = self.readiness()
        return JSONResponse(body, status_code=200 if ready else 503)

    def metrics_endpoint(self, request: Request) -> Response:
        if not self._authorized(request):
            return PlainTextResponse(
                "authentication required", status_code=401, headers={"WWW-Authenticate": 'Basic realm="metrics"'}
            )
        payload, content_type = self.metrics.render()
        return Response(payload, media_type=content_type)

    def _authorized(self, request: Request) -> bool:
        auth = self.settings.auth
        if auth is None:
            return True
        scheme, _, encoded = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, _, password = base64.b64decode(encoded, validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        # Both compared, in constant time: no early exit that tells which one was wrong.
        user_ok = hmac.compare_digest(user.encode(), auth[0].encode())
        password_ok = hmac.compare_digest(password.encode(), auth[1].encode())
        return user_ok and password_ok

    def routes(self) -> list[Route]:
        return [
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/readyz", self.readyz, methods=["GET"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
            *self.extra_routes,
        ]

    def app_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for Gradio's `FastAPI(...)`: our routes, matched before Gradio's."""
        return {"routes": self.routes()}

    def close(self) -> None:
        self.metrics.close()
