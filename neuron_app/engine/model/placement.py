"""Which device index holds which component: the `placement` setting, as the plan (real/layout.py) names it.

Neuron numbers the cores a process holds `neuron:0`, `neuron:1`, ... (TorchNeuron's device indices); CUDA its GPUs.
Each component is moved straight to its own index (never the whole pipeline to one core first: klein-9B's 27.9 GiB
would not fit there on the way), and the pipeline's execution device is the transformer's, so the latents live where
the transformer runs and diffusers moves the prompt embedding and the VAE's inputs across (its `encode_prompt` and
decode move to the component's own device).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from neuron_app.engine.model.real.layout import COMPONENTS, layout
from neuron_app.errors import DeviceUnavailable

log = logging.getLogger(__name__)


@dataclass
class Placement:
    """What the status shows: the placement in use, the setting that asked for it, and the cores of each component
    (the runtime's NeuronCore numbers where the backend knows them, else device indices)."""

    name: str | None  # None while `auto` has not chosen (it chooses at load)
    setting: str
    cores: dict[str, list[int]] = field(default_factory=dict)
    why: str = ""  # how it was chosen, in words

    def view(self) -> dict[str, Any]:
        return {"name": self.name, "setting": self.setting, "cores": dict(self.cores), "why": self.why}

    def index_of(self, component: str) -> int:
        return layout(self.name or "together").core_of(component)


def resolve(settings: Any, core_ids: list[int] | None) -> Placement:
    """The placement known at start: the topology's (chosen in the front process, scale/topology.py), else a named
    one; `together` where placement does not apply (CPU, TP > 1). Refused in one line when it needs more cores than
    the process holds. Without a topology (a manager built directly) `auto` stays undecided until the load."""
    tp, setting = settings.tp_degree, settings.placement
    if core_ids is None:
        return _placed("together", setting, None, "this device has no core indices: placement does not apply")
    if tp > 1:
        return _placed("together", setting, core_ids, f"TP {tp}: each rank holds its shard, text encoder and VAE")
    chosen = settings.topology
    name, why = (chosen["placement"], f"topology: {chosen['why']}") if chosen else (setting, "as set")
    if name == "auto":
        return Placement(None, setting, why="auto: chosen at load from the plan")
    want = layout(name).cores
    if want > len(core_ids):
        raise DeviceUnavailable(
            f"placement={name} needs {want} NeuronCores but this process holds {len(core_ids)}: give it {want} cores "
            f"(NEURON_APP_VISIBLE_CORES=0-{want - 1}, or NEURON_APP_REPLICAS=auto) or set placement=together"
        )
    return _placed(name, setting, core_ids, why)


def choose(settings: Any, core_ids: list[int], backend: Any) -> Placement:
    """`auto` at load: the first placement the plan finds fitting the served model in one of this device's cores
    (the emulator's HBM, else the instance's published figure), needing at most the cores the process holds;
    `together` for a model the plan does not know."""
    from neuron_app.engine.model.real.served import choose as plan_choice
    from neuron_app.engine.model.real.served import planned

    if planned(settings.model) is None:
        return _placed("together", "auto", core_ids, "auto: not a model the plan knows")
    hbm_gib, family = backend.memory_gib_per_core(), backend.plan_family()
    name = plan_choice(settings.model, list(settings.resolutions), family, hbm_gib, len(core_ids))
    size = f"{hbm_gib:g} GiB" if hbm_gib is not None else f"{family}'s HBM"
    chosen = _placed(name, "auto", core_ids, f"auto: the first placement the plan finds fitting {size} per core")
    log.info("placement %s (%s): %s", chosen.name, chosen.why, chosen.cores)
    return chosen


def _placed(name: str, setting: str, core_ids: list[int] | None, why: str) -> Placement:
    item = layout(name)
    cores = {}
    for component in COMPONENTS:
        index = item.core_of(component)
        cores[component] = [core_ids[index] if core_ids and index < len(core_ids) else index]
    if core_ids is None:
        cores = {component: [] for component in COMPONENTS}
    return Placement(name, setting, cores, why)


def move(pipe: Any, placement: Placement, device_at: Any) -> None:
    """Each component straight to its device (`device_at(index)`), and the execution device the transformer's."""
    for component in COMPONENTS:
        getattr(pipe, component).to(device_at(placement.index_of(component)))
    follow_transformer(pipe)


def follow_transformer(pipe: Any) -> None:
    """diffusers takes the execution device from the first accelerator component it lists (for klein the text
    encoder, measured): with the components apart the latents would be made on the text encoder's core. This
    pipeline's class answers the transformer's device."""
    cls = type(pipe)
    if getattr(cls, "follows_transformer", False):
        return
    placed = type(cls.__name__, (cls,), {"follows_transformer": True, "_execution_device": _transformer_device})
    placed.__module__ = cls.__module__
    pipe.__class__ = placed


@property  # type: ignore[misc]
def _transformer_device(self: Any) -> Any:
    return self.transformer.device
