"""The replicas' Serve deployment, once: deployed by the front end itself, or by a KubeRay RayService's config.

`start_replicas` deploys it from the front end (a local Ray or a joined cluster). A RayService names
`neuron_app.scale.serve_app:app` in its `serveConfigV2`: Ray Serve builds the same deployment from the pods'
NEURON_APP_* environment, and a front end with `ray_serve_app = "attach"` serves through it instead of deploying.
Ray is imported only inside the functions: this module is imported only on the replicas path.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from typing import Any

from neuron_app.errors import ModelLoadError
from neuron_app.settings import Settings

log = logging.getLogger(__name__)

APP_NAME = "neuron_app"
DEPLOYMENT_NAME = "FluxReplica"
NAMESPACE = "neuron_app"
#: The status board a config-deployed application creates (detached, by name), for the front ends that attach.
BOARD_NAME = "neuron_app_status_board"
#: Shortest window the load is averaged over: Ray Serve 2.58 warns (and will refuse) one not above its deprecated
#: `metrics_interval_s` (10 s by default).
LOOK_BACK_MIN_S = 11.0
#: How long an attaching front end waits for the RayService's application before it gives up (the pod restarts).
ATTACH_WAIT_S = 900.0
#: The replicas' request router, imported by Ray where requests are routed (a path: importing it imports Ray).
ROUTER_CLASS = "neuron_app.scale.routing:GraphAffinityRouter"


def deployment_scale(settings: Settings) -> dict[str, Any]:
    """A fixed `num_replicas`, or for replicas = "MIN-MAX" Ray Serve's `autoscaling_config`: it adds a replica while
    the requests per replica (running plus queued at the handles) stay above the target for the upscale delay and
    removes one while they stay below it for the downscale delay; the load is averaged over the upscale delay
    (LOOK_BACK_MIN_S..30 s)."""
    if not settings.autoscaling:
        return {"num_replicas": settings.replicas_max}
    return {
        "autoscaling_config": {
            "min_replicas": settings.replicas_min,
            "initial_replicas": settings.replicas_min,
            "max_replicas": settings.replicas_max,
            "target_ongoing_requests": settings.autoscale_target_ongoing,
            "upscale_delay_s": settings.autoscale_upscale_delay_s,
            "downscale_delay_s": settings.autoscale_downscale_delay_s,
            "look_back_period_s": min(30.0, max(LOOK_BACK_MIN_S, settings.autoscale_upscale_delay_s)),
        }
    }


#: Ray sets NEURON_RT_VISIBLE_CORES to the first free `neuron_cores` IDs it assigns, with no chip alignment; this
#: turns that off (ray/_private/accelerators/neuron.py): a replica exports its topology block's cores itself.
NOSET_CORES_VAR = "RAY_EXPERIMENTAL_NOSET_NEURON_RT_VISIBLE_CORES"


def actor_options(settings: Settings) -> dict[str, Any]:
    """Each replica reserves its whole topology block from Ray, on one node: NeuronCores as the `neuron_cores`
    resource (Ray's own IDs ignored: NOSET_CORES_VAR), GPUs on CUDA, else CPUs. A TP group's other ranks are the
    replica's children, so the one actor's reservation covers the group (docs/replicas.md: why not bundles)."""
    from neuron_app.scale.replica_server import replica_cores

    device = settings.device
    if device == "auto":  # without importing torch here: the Neuron SDK's presence decides; set cuda explicitly
        device = "neuron" if importlib.util.find_spec("torch_neuronx") else "cpu"
    if device == "neuron":
        env = {"env_vars": {NOSET_CORES_VAR: "1"}}
        return {"num_cpus": 1, "resources": {"neuron_cores": replica_cores(settings)}, "runtime_env": env}
    if device == "cuda":
        return {"num_cpus": 1, "num_gpus": replica_cores(settings)}
    return {"num_cpus": settings.cores_per_replica}


def deployment_options(settings: Settings) -> dict[str, Any]:
    """Everything `serve.deployment` is given for the replicas, whoever deploys them."""
    return {
        "name": DEPLOYMENT_NAME,
        **deployment_scale(settings),  # num_replicas, or autoscaling_config for replicas = "MIN-MAX"
        "max_ongoing_requests": 1,  # one device per replica: a busy replica is skipped by the router
        # ... yet a request waits a moment for a replica holding its graph (routing.py: why)
        "request_router_config": {"request_router_class": ROUTER_CLASS},
        "ray_actor_options": actor_options(settings),
        "health_check_period_s": 2,
        "health_check_timeout_s": 60,
        "graceful_shutdown_timeout_s": settings.shutdown_grace_s,
        "max_constructor_retry_count": 1,
        # No per-request access line: it costs each request a log write in the replica, a hop through Ray's log
        # monitor and a print in the driver; errors still reach the log.
        "logging_config": {"enable_access_log": False, "log_level": "WARNING"},
    }


def replicas_app(settings: Settings, board: Any) -> Any:
    """The bound Serve application: `ReplicaServer` with these settings and this status board."""
    from ray import serve

    from neuron_app.scale.replica_server import ReplicaServer

    return serve.deployment(ReplicaServer, **deployment_options(settings)).bind(settings, board)


def named_board() -> Any:
    """The detached status board by name, created by the first caller: it outlives the task that builds the app."""
    import ray

    from neuron_app.scale.replica_server import StatusBoard

    actor = ray.remote(num_cpus=0)(StatusBoard)
    return actor.options(name=BOARD_NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True).remote()


def app(args: dict[str, Any] | None = None) -> Any:
    """The RayService's import path: the replicas from this process's settings (the pods' NEURON_APP_* variables).

    `args` (the config's `args:`) are not used: every value comes from the settings, so that the front end and
    the replicas read one source."""
    from neuron_app.scale.topology import settle
    from neuron_app.settings import load_settings

    if args:
        log.warning("serveConfigV2 args are ignored (%s): set NEURON_APP_* variables", ", ".join(sorted(args)))
    return replicas_app(settle(load_settings()), named_board())


def attach(settings: Settings) -> tuple[Any, Any]:
    """(handle, board) of the application a RayService deployed, waiting for it up to ATTACH_WAIT_S."""
    import ray
    from ray import serve

    deadline = time.monotonic() + ATTACH_WAIT_S
    while True:
        status = serve.status().applications.get(APP_NAME)
        if status is not None and str(status.status) in ("RUNNING", "DEPLOYING", "ApplicationStatus.RUNNING"):
            try:
                board = ray.get_actor(BOARD_NAME, namespace=NAMESPACE)
            except ValueError:
                board = None
            if board is not None:
                return serve.get_app_handle(APP_NAME), board
        if time.monotonic() > deadline:
            raise ModelLoadError(
                f"no Serve application {APP_NAME!r} on {settings.ray_address} after {ATTACH_WAIT_S:.0f} s "
                "(ray_serve_app = attach waits for the RayService's serveConfigV2)"
            )
        log.info("waiting for the RayService's application %r on %s", APP_NAME, settings.ray_address)
        time.sleep(2.0)
