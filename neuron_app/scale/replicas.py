"""Many replicas on Ray Serve: every core set serving, requests routed to the replica that has the graph ready.

Each replica is a Ray Serve deployment replica that owns one `PipelineManager` (settings passed in, the cache
folder shared). Routing uses Ray Serve's model multiplexing with the compiled graph as the "model": the
multiplexed id of a request is its graph (`graph-<first configured shape with that graph>`), Serve sends it to a
replica that has that id loaded (or is loading it) and falls back to the replica with the fewest graphs when
those are busy. Loading a graph is compiling it, once per cluster: a per-graph file lock in the cache folder
lets one replica compile while the others wait and then load the result from the compiler's disk cache.

The Gradio process runs `ReplicaClient`, which implements the manager contract (engine/contract.py): web/ needs
no branch of its own. Replicas publish their status to a small `StatusBoard` actor every half second, so `status`
never queues behind a compile (each replica takes one request at a time) and a dead replica shows as unhealthy.

Ray is imported only here, and this module is imported only when `replicas > 1` or `ray_address` is set.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from neuron_app import tracing
from neuron_app.engine import requests
from neuron_app.engine.admission import Admission, Admitted
from neuron_app.engine.cache.estimates import estimate_words, human_seconds
from neuron_app.engine.modes.edit_graphs import check_edit_compiled
from neuron_app.engine.observers import Listener, Observers
from neuron_app.engine.records import (
    CompileOutcome,
    GenerationRecord,
    ManagerStatus,
    ProgressCallback,
    ProgressEvent,
    RequestFailed,
    ShapeState,
)
from neuron_app.engine.requests import Request
from neuron_app.errors import GenerationFailed, ModelLoadError, SettingsError, app_error_of, one_line
from neuron_app.scale import set_router_env
from neuron_app.scale.local_ray import init_local
from neuron_app.scale.replica_server import TRACE_FIELD, StatusBoard
from neuron_app.scale.serve_app import APP_NAME, NAMESPACE, attach, replicas_app
from neuron_app.scale.status_merge import merge_statuses
from neuron_app.settings import Settings

log = logging.getLogger(__name__)

#: A replica silent this long (it publishes every `PUBLISH_INTERVAL_S`) counts as unhealthy.
UNHEALTHY_AFTER_S = 5.0
#: A status-board read is reused this long: replicas publish every half second, so a fresher read adds nothing.
BOARD_TTL_S = 0.2
#: Seconds between progress lines while a request waits for its replica.
PROGRESS_TICK_S = 1.0
#: With replicas = "MIN-MAX", handles and replicas report their queues to Serve's controller this often (Ray's
#: default, 10 s, would add up to 10 s to every scaling decision). Read when ray.serve is imported.
AUTOSCALING_PUSH_S = 1.0


class ReplicaClient(Admitted):
    """The replicas behind the manager contract (`engine.contract.Manager`): web/ uses it like a `PipelineManager`."""

    def __init__(self, settings: Settings, handle: Any, board: Any, *, owns_ray: bool) -> None:
        self.settings = settings
        self.handle = handle
        self.board = board
        self.owns_ray = owns_ray
        self.admission = Admission()
        self._observers = Observers()
        self._lock = threading.Lock()
        self._closed = False
        self._ids: dict[str, str] = {}
        self._board_memo: tuple[float, dict[str, Any]] = (float("-inf"), {})

    # --- observers (metrics) -------------------------------------------------------------------------------
    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call `listener` with every `GenerationRecord`, `CompileOutcome` and `RequestFailed`; returns unsubscribe."""
        return self._observers.subscribe(listener)

    def _emit(self, event: Any) -> None:
        self._observers.emit(event)

    # --- device work -----------------------------------------------------------------------------------------
    def start_warmup(self) -> None:
        """Each replica warms up itself (settings.warmup) right after it loads."""
        return None

    @property
    def supports_editing(self) -> bool:
        """Every replica runs the manager's editing path; off with `max_references = 0`."""
        return self.settings.max_references > 0

    def offered_resolutions(self) -> list[str]:
        if not self.settings.only_precompiled:
            return list(self.settings.resolutions)
        return [name for name, shape in self.status().shapes.items() if shape.offered]

    def validate(
        self,
        prompt: Any,
        resolution: Any,
        steps: Any,
        seed: Any,
        *,
        lora: Any = "none",
        lora_scale: Any = 1.0,
        references: Sequence[Any] | None = None,
        **source: Any,
    ) -> Request:
        """The manager's own checks, here: a refusal costs no replica work. `source`: image, mask, strength,
        previews (previews stay on the replica: its progress events do not cross)."""
        options = {"lora": lora, "lora_scale": lora_scale, "references": references, **source}
        req = requests.validate(self.settings, self.offered_resolutions(), prompt, resolution, steps, seed, **options)
        if req.buckets and not self.settings.edits_compile_on_demand:  # by label: the replicas' graphs (row 36)
            check_edit_compiled(self.settings, self.status().edits, req.resolution, req.buckets)
        return req

    def generate(
        self,
        prompt: Any,
        resolution: Any,
        steps: Any,
        seed: Any,
        progress: ProgressCallback | None = None,
        *,
        lora: Any = "none",
        lora_scale: Any = 1.0,
        references: Sequence[Any] | None = None,
        **source: Any,
    ) -> GenerationRecord:
        """Validate here, then `run` on a replica (the manager's raw-input entry, the same parameters)."""
        options = {"lora": lora, "lora_scale": lora_scale, "references": references, **source}
        return self._admitted(lambda: self._run(self.validate(prompt, resolution, steps, seed, **options), progress))

    def run(self, request: Request, progress: ProgressCallback | None = None) -> GenerationRecord:
        """Run a validated request on a replica, which validates its portable form again with the same rules.

        A replica that dies mid-request costs this request one retry on another replica (seeded requests are
        deterministic, so the retry gives the same image); a second death is a clear error.
        """
        return self._admitted(lambda: self._run(request, progress))

    def _admitted(self, work: Callable[[], GenerationRecord]) -> GenerationRecord:
        """Counted in for `drain`, reported to observers (metrics) as the in-process manager does."""
        try:
            with self.admission.admit():
                record = work()
        except Exception as exc:
            self._emit(RequestFailed.of(exc))
            raise
        if record.compiled:
            self._emit(CompileOutcome(record.resolution, record.cache, True, record.compile_s, record.graphs_compiled))
        self._emit(record)
        return record

    def _run(self, req: Request, progress: ProgressCallback | None) -> GenerationRecord:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        shape = str(req.resolution)
        status = self.status()
        shape_status = status.shapes.get(shape)
        cold = shape_status is None or shape_status.state is not ShapeState.READY
        estimate = shape_status.estimate_s if shape_status else None
        graph_id = self._graph_id(shape)
        fields = req.portable()  # references as their uploads' bytes: a local path means nothing on another node
        if tracing.enabled():
            fields[TRACE_FIELD] = tracing.inject()  # the replica's spans continue this trace
        for attempt in (1, 2):
            response = self.handle.options(multiplexed_model_id=graph_id).generate.remote(fields)
            try:
                return self._wait(response, shape, cold, estimate, progress)
            except (RayActorError, ActorDiedError, ActorUnavailableError) as exc:
                if attempt == 2:
                    raise GenerationFailed(
                        f"generation failed: the replica serving it stopped twice ({one_line(exc, limit=120)})"
                    ) from exc
                log.warning("replica died while serving %s; retrying once on another replica", shape)
            except Exception as exc:
                raise _unwrap(exc) from exc
        raise AssertionError("unreachable")

    def _wait(
        self, response: Any, shape: str, cold: bool, estimate: float | None, progress: ProgressCallback | None
    ) -> GenerationRecord:
        """Wait for the replica's answer, telling the caller what is happening every second."""
        start = time.monotonic()
        while True:
            try:
                return response.result(timeout_s=PROGRESS_TICK_S)
            except TimeoutError:
                pass
            if progress is None:
                continue
            elapsed = time.monotonic() - start
            if cold:
                expected = estimate_words(estimate)
                message = f"Compiling {shape} on a replica: {human_seconds(elapsed)} elapsed, {expected}"
                progress(ProgressEvent("compiling", shape, message=message))
            else:
                progress(ProgressEvent("generating", shape, message=f"Generating {shape} on a replica"))

    def _graph_id(self, shape: str) -> str:
        """The shape's multiplexed id, as the replicas name it (static for the settings: asked once)."""
        if not self._ids:
            for _age, data in self._board_entries().values():
                self._ids = data.get("graph_ids", {})
                break
        return self._ids.get(shape, f"graph-{shape}")

    # --- status ------------------------------------------------------------------------------------------------
    def _board_entries(self) -> dict[str, tuple[float, dict[str, Any]]]:
        """The board's entries with their ages; one remote read per `BOARD_TTL_S` (every request asks for them)."""
        import ray

        with self._lock:
            stamp, cached = self._board_memo
            if time.monotonic() - stamp < BOARD_TTL_S:
                return cached
        try:
            now, entries = ray.get(self.board.snapshot.remote(), timeout=10)
        except Exception as exc:
            log.warning("status board unreachable: %s", one_line(exc))
            return {}
        fresh = {rid: (now - at, data) for rid, (at, data) in entries.items()}
        with self._lock:
            self._board_memo = (time.monotonic(), fresh)
        return fresh

    def status(self) -> ManagerStatus:
        """All replicas merged into the manager's status contract, plus `replicas` and per-shape `ready_replicas`."""
        entries = self._board_entries()
        replicas = []
        statuses: list[ManagerStatus] = []
        for rid, (age, data) in sorted(entries.items()):
            status: ManagerStatus = data["status"]
            healthy = age < UNHEALTHY_AFTER_S
            replicas.append(
                {
                    "id": rid,
                    "healthy": healthy,
                    "in_flight": data["in_flight"],
                    "ready_shapes": status.ready,
                    "pid": data["pid"],
                    "cores": data.get("cores"),  # its topology block
                    "seen_s_ago": round(age, 1),
                }
            )
            if healthy:
                statuses.append(status)
        return merge_statuses(self.settings, statuses, replicas)

    # --- shutdown ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the replicas; shut down the Ray instance only if this app started it (never a joined cluster)."""
        if self._closed:
            return
        self._closed = True
        import ray
        from ray import serve

        with contextlib.suppress(Exception):  # its router: with autoscaling it pushes queue metrics every second
            self.handle.shutdown()
        if self.settings.ray_serve_app == "attach":  # the RayService's replicas and board stay
            ray.shutdown()
            return
        with contextlib.suppress(Exception):
            serve.delete(APP_NAME)
        if self.owns_ray:
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()
        else:
            with contextlib.suppress(Exception):
                ray.kill(self.board)
            ray.shutdown()  # disconnects this driver; the cluster keeps running


def _unwrap(exc: Exception) -> Exception:
    """A replica's error as the manager raised it: Ray's `.cause` is the original, unpickled with its fields."""
    known = app_error_of(exc)
    if known is not None:
        return known
    return GenerationFailed(f"generation failed on a replica: {one_line(exc, limit=200)}")


#: `serve.run` reports a replica's failed constructor only as text (the replica's traceback, flattened).
_START_ERROR = re.compile(r"ModelLoadError: (.+)")


def start_failure(exc: BaseException) -> ModelLoadError:
    """Why the replicas did not start: the replica's own `ModelLoadError` line when the text carries one."""
    known = app_error_of(exc)
    if isinstance(known, ModelLoadError):
        return known
    match = _START_ERROR.search(str(exc))
    if match:
        return ModelLoadError(match.group(1).strip())
    return ModelLoadError(f"the replicas failed to start: {one_line(exc, limit=300)}")


# --- start ---------------------------------------------------------------------------------------------------------
def start_replicas(settings: Settings) -> ReplicaClient:
    """Start (or join) Ray, deploy `replicas` replicas and wait until they are up; returns the manager-shaped client.

    A replica that cannot load the model fails the start with the manager's own one-line `ModelLoadError`.
    """
    from neuron_app.engine.model.loader import resolve_source
    from neuron_app.settings import PROJECT_ROOT

    resolve_source(settings)  # a bad model path: the same one-line error as the single-process app, before Ray
    set_router_env()
    pushes = {}
    if settings.autoscaling:
        names = (
            "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S",
            "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S",
        )
        pushes = {name: os.environ.setdefault(name, str(AUTOSCALING_PUSH_S)) for name in names}
    try:
        import ray
        from ray import serve
    except ModuleNotFoundError as exc:  # the single-process install (requirements.txt) has no Ray
        raise SettingsError(
            "replicas > 1 and ray_address need Ray Serve, which requirements.txt does not install:"
            " pip install -r requirements-replicas.txt"
        ) from exc

    owns_ray = not settings.ray_address
    from neuron_app.environment import forwarded_env

    # The fallback switches and NEFF folder as this process exported them: a joined cluster's workers do not
    # inherit this environment (each replica also runs prepare_process itself).
    env_vars = {"PYTHONPATH": str(PROJECT_ROOT), "TOKENIZERS_PARALLELISM": "false", **forwarded_env(), **pushes}
    runtime_env = {"env_vars": env_vars}
    init: dict[str, Any] = {"namespace": NAMESPACE, "runtime_env": runtime_env, "logging_level": logging.WARNING}
    if owns_ray:
        on_cpu = settings.device in ("cpu", "auto", "neuron-emulated")
        cpus = settings.replicas_max * (settings.cores_per_replica if on_cpu else 1)
        init_local(ray, num_cpus=cpus, include_dashboard=False, **init)
    else:
        ray.init(address=settings.ray_address, **init)
    try:
        if settings.ray_serve_app == "attach":  # a RayService deployed the replicas (serve_app.app): use them
            handle, board = attach(settings)
        else:
            board = ray.remote(num_cpus=0)(StatusBoard).remote()
            serve.start(proxy_location="Disabled")
            handle = serve.run(replicas_app(settings, board), name=APP_NAME, route_prefix=None)
    except Exception as exc:
        with contextlib.suppress(Exception):
            if settings.ray_serve_app != "attach":  # never the RayService's application
                serve.delete(APP_NAME) if not owns_ray else serve.shutdown()
        ray.shutdown()
        raise start_failure(exc) from None
    client = ReplicaClient(settings, handle, board, owns_ray=owns_ray)
    where = "local Ray" if owns_ray else settings.ray_address
    if settings.autoscaling:
        log.info("%d replica(s) up on Ray Serve (%s), scaling %d-%d with the queue", settings.replicas_min, where,
                 settings.replicas_min, settings.replicas_max)  # fmt: skip
    else:
        log.info("%d replica(s) up on Ray Serve (%s)", settings.replicas_max, where)
    return client
