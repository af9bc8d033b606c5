"""How an instance is laid out: copies x TP x placement x cores, chosen once, read everywhere.

The front process (app start, `doctor`, scripts/launch-trn.sh through `python -m neuron_app topology`) chooses the
topology before any replica or rank starts, against the cores this host holds, from the plan
(engine/model/real/best.py `best`), and writes it into the settings (`topology`, with `replicas`, `tp_degree`
and the placement it implies) that it hands to its Ray replicas and torchrun ranks. They read it; nobody
derives a core index again:

- a copy is one model copy: one process at TP 1 (its block holds its placement's cores: `text-encoder-apart` 2),
  one TP group of `tp` processes at TP > 1, each rank on one core of the block;
- its block: aligned (pairs 2k..2k+1, quads 4k..4k+3), disjoint, on one chip (layout.blocks): Trn2 collectives
  route only for such groups, and a Ray replica's cores are the app's, not Ray's first-free IDs;
- a rank's environment (`rank_env`): NEURON_RT_VISIBLE_CORES = its one core, set before torch touches the device,
  and NEURON_RT_ROOT_COMM_ID = localhost:(61234 + the block's lowest core), as vLLM-Neuron derives it (a probed
  free port raced when several groups started together); each group's rendezvous gets its own port.

A topology that does not fit the cores held is refused at start, in one line naming both (SettingsError).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from neuron_app.errors import SettingsError

#: vLLM-Neuron's CCOM base port: a group's root communicator listens on this plus its lowest core.
ROOT_COMM_BASE_PORT = 61234
ROOT_COMM_VAR = "NEURON_RT_ROOT_COMM_ID"
#: TorchNeuron refuses more than 128 devices in a process, and 128 already overflows torch's 8-bit device index
#: (the seventh review's V9): a process never takes more than this many cores.
MOST_CORES_PER_PROCESS = 127


@dataclass(frozen=True)
class Topology:
    """One instance's layout (the status's `topology`, `plan --best`'s JSON)."""

    tp: int
    placement: str
    copies: int
    core_blocks: list[list[int]]
    images_per_s_floor: float | None
    floor_s_per_image: float | None
    goal: str
    why: str
    cores_held: int | None = None
    cores_per_copy: int | None = None  # a copy's cores: TP, or its placement's at TP 1

    def view(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of(cls, view: dict[str, Any]) -> Topology:
        return cls(**{k: view.get(k) for k in cls.__dataclass_fields__})  # type: ignore[arg-type]

    def block(self, copy: int) -> list[int]:
        return self.core_blocks[copy]


def rank_env(block: list[int], rank: int | None) -> dict[str, str]:
    """What a process of the copy on `block` must export before torch touches the device: its own core (`rank` of
    a TP group: one core per rank), or the whole block (`rank` None: a TP-1 copy holds its placement's cores), and
    its group's root communicator."""
    from neuron_app.environment import VISIBLE_CORES_VAR

    whole = f"{block[0]}-{block[-1]}" if len(block) > 1 else str(block[0])
    cores = whole if rank is None else str(block[rank])
    return {VISIBLE_CORES_VAR: cores, ROOT_COMM_VAR: f"localhost:{ROOT_COMM_BASE_PORT + block[0]}"}


def apply_rank_env(block: list[int], rank: int | None) -> None:
    """`rank_env` into this process's environment (before torch, TorchNeuron or the emulator read it)."""
    os.environ.update(rank_env(block, rank))


# --- the cores held ------------------------------------------------------------------------------------------------
def held_cores(settings: Any, device: str | None = None) -> list[int] | None:
    """The NeuronCore numbers this host gives the app: `visible_cores` (NEURON_APP_VISIBLE_CORES), else
    NEURON_RT_VISIBLE_CORES, else every core of the instance (the emulated one's, or this EC2 size's); None on a
    device without core numbers (CPU, CUDA)."""
    from neuron_app.environment import VISIBLE_CORES_VAR, parse_cores

    given = settings.visible_cores or os.environ.get(VISIBLE_CORES_VAR, "").strip()
    device = device or _device(settings)
    if device not in ("neuron", "neuron-emulated"):
        return None
    if given:
        first, last = parse_cores(given)
        return list(range(first, last + 1))
    if device == "neuron-emulated":
        from neuron_app.backends.emulator import cores

        return list(range(cores.instance().cores))
    from neuron_app.engine.model.real.best import host_cores
    from neuron_app.engine.model.real.catalog import instance

    return host_cores(instance("trn2"), None)


def _device(settings: Any) -> str:
    if settings.device != "auto":
        return settings.device
    import importlib.util

    return "neuron" if importlib.util.find_spec("torch_neuronx") else "cpu"


# --- choosing -------------------------------------------------------------------------------------------------------
def choose(settings: Any, cores: list[int] | None = None, *, in_process: bool = False) -> Topology:
    """The topology for `settings` on `cores` (default: `held_cores`). `replicas`/`tp_degree` = "auto" take the plan's
    best for `topology_goal`; set values are laid out as given, and refused when they do not fit."""
    from neuron_app.engine.model.real.layout import blocks, layout
    from neuron_app.engine.model.real.served import planned

    cores = held_cores(settings) if cores is None else cores
    tp_auto, copies_auto = _is_auto(settings.tp_degree), _is_auto(settings.replicas)
    goal = settings.topology_goal
    if cores is None:
        tp, copies = (1 if tp_auto else int(settings.tp_degree)), (1 if copies_auto else settings.replicas_max)
        placement = "together" if settings.placement == "auto" else settings.placement
        return Topology(tp, placement, copies, [], None, None, goal, f"{_device(settings)}: no NeuronCores to lay out")
    if len(cores) > MOST_CORES_PER_PROCESS and not (settings.replicas_max > 1 or tp_auto or copies_auto):
        raise SettingsError(
            f"this process would hold {len(cores)} NeuronCores, more than torch's device index takes "
            f"({MOST_CORES_PER_PROCESS}): set NEURON_APP_VISIBLE_CORES (e.g. 0-63) or NEURON_APP_REPLICAS=auto"
        )
    if planned(settings.model) is not None:
        found = Topology.of(_plan_best(settings, cores, None if tp_auto else int(settings.tp_degree), in_process))
    else:  # a model the plan does not know: its placement as set (auto: together), blocks of its width
        from neuron_app.engine.model.real.catalog import instance

        tp = 1 if tp_auto else int(settings.tp_degree)
        placement = "together" if settings.placement == "auto" or tp > 1 else settings.placement
        width = tp if tp > 1 else layout(placement).cores
        laid = blocks([0.0] * width, instance("trn2"), cores)
        why = f"{settings.model}: not a model the plan knows; {placement} at TP {tp} on aligned blocks of {width}"
        found = Topology(tp, placement, len(laid), laid, None, None, goal, why, len(cores), width)
    wanted = found.copies if copies_auto else settings.replicas_max
    cluster = bool(settings.ray_address) and found.copies > 0  # every node has these blocks: Ray spreads the copies
    if wanted < 1 or (wanted > found.copies and not cluster):
        raise SettingsError(refusal(settings, found, cores, wanted))
    laid = found.core_blocks if cluster else found.core_blocks[:wanted]  # a replica takes a free block of its node
    rate = round(wanted / found.floor_s_per_image, 3) if found.floor_s_per_image else None
    floor = found.floor_s_per_image
    return Topology(
        found.tp, found.placement, wanted, laid, rate, floor, goal, found.why, len(cores), found.cores_per_copy
    )


def refusal(settings: Any, found: Topology, cores: list[int], wanted: int) -> str:
    """One line naming the topology and the cores held."""
    copies = max(wanted, 1)
    width = found.cores_per_copy or found.tp
    need = copies * width
    span = f"{len(cores)} (cores {cores[0]}-{cores[-1]})" if cores else "none"
    give = f"NEURON_APP_VISIBLE_CORES=0-{need - 1}" if need > 1 else "one core"
    what = f"{copies} cop{'y' if copies == 1 else 'ies'} of TP {found.tp} ({found.placement})"
    return (
        f"topology: {what} need{'s' if copies == 1 else ''} {need} NeuronCores ({copies} aligned block(s) of "
        f"{width}), but this host holds {span}, room for {found.copies} ({found.why}): give it {need} cores "
        f"({give}), or lower NEURON_APP_REPLICAS / NEURON_APP_TP_DEGREE (or auto)"
    )


def _is_auto(value: Any) -> bool:
    return bool(getattr(value, "auto", False))


def _plan_best(settings: Any, cores: list[int], tp: int | None, in_process: bool = False) -> dict[str, Any]:
    """The plan's best topology, measured in a child process whose torch never loads the Neuron backend (V8: the
    front process may already hold cores; planning needs none), or here (`in_process`: `doctor`, which holds
    none and serves nothing)."""
    from neuron_app.engine.model.real.served import run_best

    hbm = None
    if _device(settings) == "neuron-emulated":
        from neuron_app.backends.emulator.cores import hbm_per_core_gib

        hbm = hbm_per_core_gib()
    setting = settings.placement if not tp or tp == 1 else "auto"
    if in_process:
        from neuron_app.engine.model.real.best import best
        from neuron_app.engine.model.real.catalog import instance, spec_name
        from neuron_app.shapes import Resolution

        shapes = [Resolution.parse(s) for s in settings.resolutions]
        spec, goal, tps = spec_name(settings.model), settings.topology_goal, [tp] if tp else None
        return best(spec, settings.model, shapes, instance(_family()), cores, goal, tps, hbm, setting)
    return run_best(
        settings.model, list(settings.resolutions), cores, settings.topology_goal, tp, hbm, setting, _family()
    )


def _family() -> str:
    """This instance's Trainium family (trn2 where it is not one)."""
    from neuron_app.engine.model.real.best import this_instance_type

    found = this_instance_type()
    return found.split(".")[0] if found else "trn2"


def settle(settings: Any) -> Any:
    """The settings every later part reads: the topology (chosen here once; one already chosen, by the launcher or
    the front process, is kept), with `tp_degree` and an "auto" `replicas` written from it."""
    found = of(settings) or choose(settings)
    update: dict[str, Any] = {"topology": found.view(), "tp_degree": found.tp}
    if _is_auto(settings.replicas):
        from neuron_app.settings import ReplicaRange

        update["replicas"] = ReplicaRange(found.copies)
    if settings.topology == update["topology"] and settings.tp_degree == found.tp and "replicas" not in update:
        return settings
    return settings.model_copy(update=update)


def of(settings: Any) -> Topology | None:
    """The topology the front process chose (None: not chosen, e.g. a manager built directly by a test)."""
    return Topology.of(settings.topology) if settings.topology else None
