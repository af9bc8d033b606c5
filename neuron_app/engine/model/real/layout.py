"""Where the plan puts a pipeline's components on NeuronCores: only the placements the app serves.

Torch-free, so that the settings, the manager and `doctor` name placements without importing the measurement.
A placement is the `placement` setting's value; the app (engine/model/placement.py) and the plan read the same table,
so every row the plan prints is one the app can be told to serve (the fifth review's U1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from neuron_app.engine.model.real.catalog import GIB, Instance

COMPONENTS = ("transformer", "text_encoder", "vae")


@dataclass(frozen=True)
class Layout:
    """One value of the `placement` setting: the components given a core of their own, beside the transformer's."""

    setting: str
    words: str  # how the plan's table says it
    apart: tuple[str, ...]

    @property
    def cores(self) -> int:
        """Cores one copy of the pipeline holds at TP 1."""
        return 1 + len(self.apart)

    def core_of(self, component: str) -> int:
        """The device index (within the process's cores) that holds `component`."""
        return 1 + self.apart.index(component) if component in self.apart else 0


#: Tried in this order by `auto` and by the plan: the first whose every core fits.
LAYOUTS: tuple[Layout, ...] = (
    Layout("together", "together", ()),
    Layout("text-encoder-apart", "text encoder on its own core", ("text_encoder",)),
    Layout("text-encoder-and-vae-apart", "text encoder and VAE on their own cores", ("text_encoder", "vae")),
)

SETTINGS = tuple(layout.setting for layout in LAYOUTS)


def layout(setting: str) -> Layout:
    return next(item for item in LAYOUTS if item.setting == setting)


def served(tp: int) -> tuple[Layout, ...]:
    """The placements the app serves at `tp`. Under torchrun each rank holds one core (TorchNeuron gives rank N the
    core of its LOCAL_RANK), so with TP > 1 every rank holds its shard, a text encoder and a VAE: `together`."""
    return LAYOUTS if tp == 1 else LAYOUTS[:1]


def core_loads(item: Layout, measured: dict[str, Any], tp: int) -> list[dict[str, Any]]:
    """Each core one copy holds: its components, weights, the largest activation peak among them (they run one
    after another). The transformer's core is repeated for each TP rank."""
    shared = tuple(c for c in COMPONENTS if c not in item.apart)
    held = [shared] * tp + [(c,) for c in item.apart]
    loads = []
    for components in held:
        weights = sum(measured[c].weight_bytes for c in components)
        activations = max(measured[c].activation_bytes for c in components)
        loads.append({"holds": list(components), "weights": weights, "activations": activations})
    return loads


def banks_fit(loads_gib: list[float], inst: Instance, start: int = 0, used: dict[int, float] | None = None) -> bool:
    """Whether cores `start`, `start + 1`, ... holding `loads_gib` (each with the runtime's reserve) fit their banks,
    beside what `used` already holds per bank: at LNC=1 two neighbouring cores draw on one bank, so their sum is
    what must fit."""
    per_bank = dict(used or {})
    for offset, load in enumerate(loads_gib):
        bank = (start + offset) // inst.cores_per_bank
        per_bank[bank] = per_bank.get(bank, 0.0) + load + inst.reserve_gib_per_core
    return all(total <= inst.bank_gib + 1e-9 for total in per_bank.values())


def _take(loads_gib: list[float], inst: Instance, start: int, used: dict[int, float]) -> None:
    for offset, load in enumerate(loads_gib):
        bank = (start + offset) // inst.cores_per_bank
        used[bank] = used.get(bank, 0.0) + load + inst.reserve_gib_per_core


def place(
    measured: dict[str, Any], tp: int, inst: Instance, hbm_gib: float | None = None, setting: str = "auto"
) -> dict[str, Any]:
    """The first served placement whose banks fit (`setting` auto); else the last served one (the least per core),
    not fitting. A named `setting` is planned as it is (not fitting where the app does not serve it at `tp`).
    `hbm_gib` replaces the bank's size (the emulator's NEURON_EMULATOR_HBM_GIB, when `auto` plans for it)."""
    if hbm_gib is not None:
        inst = _with_bank(inst, hbm_gib)
    candidates = served(tp) if setting == "auto" else (layout(setting),)
    for item in candidates:
        loads = core_loads(item, measured, tp)
        gib = [(load["weights"] + load["activations"]) / GIB for load in loads]
        fits = banks_fit(gib, inst) and item in served(tp)
        if fits or item is candidates[-1]:
            break
    fullest = max(loads, key=lambda load: load["weights"] + load["activations"])
    shared = loads[0]
    per_core = [{"cores": tp, "holds": shared["holds"], "gib": _gib(shared, inst)}]
    per_core += [{"cores": 1, "holds": load["holds"], "gib": _gib(load, inst)} for load in loads[tp:]]
    return {
        "placement": {
            "name": item.words,
            "setting": item.setting,
            "cores_used": len(loads),
            "cores": per_core,
            "device_index": {c: [item.core_of(c)] if tp == 1 else list(range(tp)) for c in COMPONENTS},
        },
        "fits": fits,
        "fullest": fullest,
        "loads_gib": gib,
        "inst": inst,
    }


def _gib(load: dict[str, Any], inst: Instance) -> float:
    return round((load["weights"] + load["activations"]) / GIB + inst.reserve_gib_per_core, 3)


def _with_bank(inst: Instance, gib: float) -> Instance:
    from dataclasses import replace

    return replace(inst, bank_gib=gib)


def block_width(cores: int) -> int:
    """The cores a copy's block spans: its cores rounded up to a power of two, so that every block starts at a
    multiple of its width (pairs 2k..2k+1, quads 4k..4k+3): on one chip, the same core offsets on every chip (Trn2
    collectives route only for such groups, docs/replicas.md)."""
    width = 1
    while width < cores:
        width *= 2
    return width


def blocks(loads_gib: list[float], inst: Instance, cores: Sequence[int]) -> list[list[int]]:
    """The disjoint copies of one placement among the `cores` held (core numbers): each on cores start..start+n-1
    where start is a multiple of `block_width(n)`, inside one chip and the cores held, its banks fitting beside the
    copies before it (at LNC=1 two neighbouring cores share a bank). Every core index of a topology comes from here."""
    held = set(cores)
    width = block_width(len(loads_gib))
    found: list[list[int]] = []
    used: dict[int, float] = {}  # bank -> GiB held
    for start in range(0, max(held, default=-1) + 1, width):
        block = list(range(start, start + len(loads_gib)))
        if not held.issuperset(block) or start // inst.cores_per_chip != block[-1] // inst.cores_per_chip:
            continue
        if banks_fit(loads_gib, inst, start, used):
            _take(loads_gib, inst, start, used)
            found.append(block)
    return found


def instance_view(
    loads_gib: list[float], inst: Instance, floor_s: float, type_name: str | None, tp: int = 1
) -> dict[str, Any]:
    """How many copies of this placement an EC2 instance holds (`blocks`: aligned, disjoint, each on one chip; a TP
    group is one copy on its block of `tp` cores, its own torchrun world), and its floor in images per second (each
    copy serves one image at a time)."""
    from neuron_app.engine.model.real.catalog import instance_types

    if type_name is None:
        return {"instance_type": None, "replicas": None, "tp": tp, "images_per_s_floor": None, "cores": None}
    _family, chips = instance_types()[type_name]
    total = chips * inst.cores_per_chip
    replicas = len(blocks(loads_gib, inst, range(total)))
    return {
        "instance_type": type_name,
        "cores": total,
        "replicas": replicas,
        "tp": tp,
        "images_per_s_floor": round(replicas / floor_s, 3) if replicas and floor_s > 0 else 0.0,
    }
