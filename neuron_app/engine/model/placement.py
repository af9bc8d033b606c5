"""Which device index holds which component: the `placement` setting, as the plan (real/layout.py) names it.

Neuron numbers the cores a process holds `neuron:0`, `neuron:1`, ... (TorchNeuron's device indices); CUDA its GPUs.
Each component is moved straight to its own index (never the whole pipeline to one core first: klein-9B's 27.9 GiB
would not fit there on the way), and the pipeline's execution device is the transformer's, so the latents live where
the transformer runs.

Between two NeuronCores nothing is copied directly: TorchNeuron refuses a copy between two device indices ("Device-to-
device copy requires tensors on same Neuron core", the seventh review's V1). Every crossing (the prompt embedding from
the text encoder's core; with the VAE apart, the latents to the VAE's core and an edit's reference latents back) goes
to the host and back (`to_core`), at the pipeline's seams (`place_pipeline`: diffusers' own code is not patched). And
a compiled graph runs on the thread's current device, which TorchNeuron moves at every allocation (V2): each stage
runs with its own core current (the text encoder's, the transformer's for the call, the VAE's for the decode).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from neuron_app.crossing import to_core
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


def move(pipe: Any, placement: Placement, device_at: Any, switch: Any = None) -> None:
    """Each component straight to its device (`device_at(index)`), and the pipeline's seams placed."""
    for component in COMPONENTS:
        getattr(pipe, component).to(device_at(placement.index_of(component)))
    place_pipeline(pipe, placement, switch)


def place_pipeline(pipe: Any, placement: Placement, switch: Any = None) -> None:
    """The pipeline's class, for components apart: its execution device is the transformer's (diffusers takes the
    first accelerator component it lists, for klein the text encoder); the text encoder runs with its core current
    and its embedding crosses through the host; with the VAE apart the unpacked latents cross to the VAE's core
    (where the pipeline then de-normalises them with the VAE's batch-norm statistics and decodes, with that core
    current) and an edit's reference latents cross back. `switch` (the backend) reads and sets the current device."""
    cls = type(pipe)
    if getattr(cls, "follows_transformer", False):
        return
    index = {component: placement.index_of(component) for component in COMPONENTS}
    stage = _Stages(switch)

    def _get_qwen3_prompt_embeds(text_encoder: Any, *args: Any, device: Any = None, **kwargs: Any) -> Any:
        with stage.on(index["text_encoder"]):  # made on the text encoder's core, then across
            out = cls._get_qwen3_prompt_embeds(text_encoder, *args, device=None, **kwargs)
        return out if device is None else to_core(out, device)

    def prepare_image_latents(self: Any, images: Any, batch_size: Any, generator: Any, device: Any, dtype: Any) -> Any:
        from diffusers.utils.torch_utils import get_module_execution_device

        with stage.on(index["vae"]):
            own = get_module_execution_device(self.vae)
            latents, ids = cls.prepare_image_latents(self, images, batch_size, generator, own, dtype)
        return to_core(latents, device), to_core(ids, device)

    def _encode_vae_image(self: Any, image: Any, generator: Any) -> Any:
        with stage.on(index["vae"]):
            return cls._encode_vae_image(self, image, generator)

    def _unpack_latents_with_ids(*args: Any, **kwargs: Any) -> Any:
        from diffusers.utils.torch_utils import get_module_execution_device

        out = cls._unpack_latents_with_ids(*args, **kwargs)
        vae = get_module_execution_device(pipe.vae)
        stage.switch(index["vae"])  # the decode's stage: the call's own scope restores the device after it
        return to_core(out, vae)

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        with stage.on(index["transformer"]):
            return cls.__call__(self, *args, **kwargs)

    body: dict[str, Any] = {
        "follows_transformer": True,
        "_execution_device": _transformer_device,
        "_get_qwen3_prompt_embeds": staticmethod(_get_qwen3_prompt_embeds),
        "__call__": __call__,
    }
    if "vae" in layout(placement.name or "together").apart:
        body |= {
            "prepare_image_latents": prepare_image_latents,
            "_encode_vae_image": _encode_vae_image,
            "_unpack_latents_with_ids": staticmethod(_unpack_latents_with_ids),
        }
    placed = type(cls.__name__, (cls,), body)
    placed.__module__ = cls.__module__
    pipe.__class__ = placed


class _Stages:
    """The current device per pipeline stage, through the backend's `current_device_index` /
    `set_current_device` (a compiled graph runs on the current device: TorchNeuron's executor reads it)."""

    def __init__(self, switch: Any) -> None:
        self.backend = switch

    def switch(self, index: int) -> None:
        if self.backend is not None:
            self.backend.set_current_device(index)

    @contextlib.contextmanager
    def on(self, index: int) -> Iterator[None]:
        before = self.backend.current_device_index() if self.backend is not None else None
        self.switch(index)
        try:
            yield
        finally:
            if before is not None:
                self.switch(before)


@property  # type: ignore[misc]
def _transformer_device(self: Any) -> Any:
    return self.transformer.device
