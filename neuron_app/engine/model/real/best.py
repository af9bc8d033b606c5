"""`python -m neuron_app plan --best` and `auto` topologies (scale/topology.py): for each TP degree the placement
fitting every shape, its aligned core blocks, the floor per image, and the best by the goal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from neuron_app.engine.model.real import layout
from neuron_app.engine.model.real.catalog import Instance, load_spec
from neuron_app.engine.model.real.fit import plan_one
from neuron_app.shapes import Resolution

#: What `--best` (and `replicas`/`tp_degree` = "auto") maximises: images per second of the instance, or the
#: shortest floor per image (then images per second).
GOALS = ("throughput", "latency")
#: TP degrees a topology tries: powers of two, so that a group's block is aligned on one chip (layout.block_width).
BEST_TPS = (1, 2, 4, 8)


def best(
    spec: str,
    model: str,
    shapes: list[Resolution],
    inst: Instance,
    cores: list[int],
    goal: str = "throughput",
    tps: list[int] | None = None,
    hbm_gib: float | None = None,
    setting: str = "auto",
) -> dict[str, Any]:
    """The topology `auto` serves: for each TP degree (`tps`, else every power of two that divides the heads and fits
    one chip and the cores held), the placement fitting every shape (the widest `auto` picks among them), its
    aligned blocks among `cores`, the floor per image (the slowest shape's) and the instance's images per second;
    the best by `goal`. No candidate fits: `copies` 0 and `why` says what was tried."""
    heads = load_spec(spec)["transformer"]["num_attention_heads"]
    limit = min(inst.cores_per_chip, len(cores))
    tried = tps or [tp for tp in BEST_TPS if heads % tp == 0 and tp <= limit]
    options, notes = [], []
    for tp in tried:
        rows = [plan_one(spec, model, s, tp, inst, 0, None, hbm_gib, setting) for s in shapes]
        if not all(r["fits"] for r in rows):
            worst = max(rows, key=lambda r: r["total_gib_per_core"])
            notes.append(f"TP {tp}: {worst['shape']} does not fit ({worst['total_gib_per_core']:.1f} GiB per core)")
            continue
        chosen = max((r["placement"]["setting"] for r in rows), key=layout.SETTINGS.index)
        if any(r["placement"]["setting"] != chosen for r in rows):  # the widest placement, planned at every shape
            rows = [plan_one(spec, model, s, tp, inst, 0, None, hbm_gib, chosen) for s in shapes]
        loads = [max(column) for column in zip(*(r["core_loads_gib"] for r in rows), strict=True)]
        found = layout.blocks(loads, inst, cores)
        floor = max(r["floor_s_per_image"] for r in rows)
        rate = round(len(found) / floor, 3) if found and floor > 0 else 0.0
        notes.append(f"TP {tp}: {len(found)} x {chosen} at {floor:.3f} s = {rate:g}/s")
        options.append((tp, chosen, found, floor, rate, len(loads)))
    key = (lambda o: (o[4], -o[0])) if goal == "throughput" else (lambda o: (bool(o[2]), -o[3], o[4]))
    span = f"cores {cores[0]}-{cores[-1]}" if cores else "no cores"
    if not any(o[2] for o in options):  # none laid out: the copy that needs the fewest cores, with 0 copies
        first = (tried or [1])[0]
        fallback = min(options, key=lambda o: o[5]) if options else (first, setting, [], None, 0.0, first)
        tp, chosen, _, floor, _, width = fallback
        why = f"nothing fits {span} ({'; '.join(notes) or 'no TP degree tried'})"
        return _topology(tp, chosen, [], floor, 0.0, goal, why, cores, width)
    tp, chosen, found, floor, rate, width = max(options, key=key)
    why = f"{goal}: best of {'; '.join(notes)} on {span} ({inst.name} LNC={inst.lnc})"
    return _topology(tp, chosen, found, floor, rate, goal, why, cores, width)


def _topology(
    tp: int,
    placement: str,
    found: list[list[int]],
    floor: float | None,
    rate: float,
    goal: str,
    why: str,
    cores: Any,
    width: int,
) -> dict[str, Any]:
    return {
        "tp": tp,
        "placement": placement,
        "copies": len(found),
        "core_blocks": found,
        "cores_per_copy": width,
        "images_per_s_floor": rate,
        "floor_s_per_image": floor,
        "goal": goal,
        "why": why,
        "cores_held": len(cores),
    }


def host_cores(inst: Instance, type_name: str | None) -> list[int]:
    """The cores `--best` lays copies on: NEURON_RT_VISIBLE_CORES' range where this process has one, else every core
    of `type_name` (this EC2 instance's size where it is a Trainium, else the family's smallest)."""
    import os

    from neuron_app.engine.model.real.catalog import instance_types
    from neuron_app.environment import VISIBLE_CORES_VAR, parse_cores

    visible = os.environ.get(VISIBLE_CORES_VAR, "").strip()
    if visible and type_name is None:
        first, last = parse_cores(visible)
        return list(range(first, last + 1))
    name = type_name or this_instance_type() or inst.default_instance_type
    _family, chips = instance_types()[name]
    return list(range(chips * inst.cores_per_chip))


def this_instance_type() -> str | None:
    from neuron_app.engine.model.real.catalog import instance_types

    try:
        found = Path("/sys/devices/virtual/dmi/id/product_name").read_text(errors="replace").strip().lower()
    except OSError:
        return None
    return found if found in instance_types() else None


def topology_words(t: dict[str, Any]) -> str:
    """A topology in one line: "32 copies of TP 2 (together) on cores [0, 1], [2, 3], ...: 31.9 images/s ..." """
    shown = ", ".join(str(b) for b in t["core_blocks"][:4]) + (", ..." if len(t["core_blocks"]) > 4 else "")
    floor = f"{t['floor_s_per_image']:.3f} s per image" if t["floor_s_per_image"] else "no floor planned"
    rate = f"{t['images_per_s_floor']:g} images/s floor, " if t["images_per_s_floor"] is not None else ""
    copies = f"{t['copies']} cop{'y' if t['copies'] == 1 else 'ies'}"
    return f"{copies} of TP {t['tp']} ({t['placement']}) on cores {shown or '(none)'}: {rate}{floor}; {t['why']}"
