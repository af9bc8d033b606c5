"""How the engine spreads over cores and machines: torchrun lockstep (tensor parallel), Ray Serve replicas."""

from __future__ import annotations

from neuron_app.engine.contract import Manager
from neuron_app.settings import Settings


def make_manager(settings: Settings) -> Manager:
    """The app's manager for `settings`: Ray Serve replicas when `replicas > 1` or `ray_address` is set, else the
    in-process `PipelineManager` (Ray is not imported on that path)."""
    if settings.uses_replicas:
        from neuron_app.scale.replicas import start_replicas

        return start_replicas(settings)
    from neuron_app.engine.manager import PipelineManager

    return PipelineManager(settings)
