"""How the engine spreads over cores and machines: torchrun lockstep (tensor parallel), Ray Serve replicas."""

from __future__ import annotations

import os

from neuron_app.engine.contract import Manager
from neuron_app.settings import Settings

#: Ray Serve's router, tuned for replicas that take one request each and whose "model" is a compiled graph (a
#: request sent to a replica without it costs a compile or a disk load). Ray reads these when ray.serve is first
#: imported, in the process that holds the handle (the Gradio front end; a RayService's proxy takes them from the
#: pod's env, deploy/kubernetes).
ROUTER_ENV = {
    # A request waiting for a free replica re-polls with exponential backoff, by default up to 0.5 s: with one
    # request per replica that leaves replicas idle between short requests.
    "RAY_SERVE_ROUTER_RETRY_MAX_BACKOFF_S": "0.05",
    # The router asks the graph's replica for its queue length and, without an answer in 0.1 s (a loaded host),
    # treats it as busy and goes to the replica with the fewest graphs: seen in CI, two of six requests.
    "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "1.0",
    "RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "5.0",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def set_router_env() -> None:
    """ROUTER_ENV into this process's environment, where not already set (before ray.serve is imported)."""
    for name, value in ROUTER_ENV.items():
        os.environ.setdefault(name, value)


def make_manager(settings: Settings) -> Manager:
    """The app's manager for `settings` (its topology chosen first, once: scale/topology.py): Ray Serve replicas
    when `replicas > 1` or `ray_address` is set, each one copy (a TP group at TP > 1), else the in-process
    `PipelineManager` (Ray is not imported on that path)."""
    from neuron_app.scale.topology import settle

    settings = settle(settings)
    if settings.uses_replicas:
        from neuron_app.scale.replicas import start_replicas

        return start_replicas(settings)
    from neuron_app.engine.manager import PipelineManager

    return PipelineManager(settings)
