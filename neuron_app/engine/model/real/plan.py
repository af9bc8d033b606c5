"""`python -m neuron_app plan`: before any compile, what fits on which NeuronCores and the fastest an image can be.

For each model x shape x TP x instance, from the fake-tensor measurements (measure.py) and the instance's published
figures (specs/instances.json, cited in docs/real-size.md):
- memory per core: weights of the components a core holds plus the largest activation peak among them (they run
  one after another); the transformer at its TP shard;
- a placement, among those the app serves (layout.py, the `placement` setting): everything on each TP core if it
  fits, else the text encoder on a core of its own, else the VAE too; checked per HBM bank with the runtime's reserve;
- edits (`--references N`): the references join the transformer's tokens, and each is encoded once;
- an instance view: how many copies of that placement an EC2 size holds, and its floor in images per second;
- a roofline floor per image: each call takes at least max(FLOPs / peak bfloat16 rate, weight bytes / HBM
  bandwidth) of one core (weights read once per call; collectives and activation traffic left out: a lower bound).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from neuron_app.engine.model.real import layout
from neuron_app.engine.model.real.catalog import (
    GIB,
    Instance,
    check_tp,
    instance,
    instance_type,
    load_spec,
    spec_name,
)
from neuron_app.errors import RequestError
from neuron_app.shapes import Resolution


@dataclass(frozen=True)
class Request:
    """Checked arguments: nothing heavy is imported until every one of them is valid."""

    model: str
    spec: str
    shapes: list[Resolution]
    tps: list[int]
    instances: list[Instance]
    references: list[int]
    instance_types: dict[str, str]  # family -> the EC2 size its instance view counts
    hbm_gib: float | None = None
    placement: str = "auto"
    cores: list[int] | None = None  # --cores: the core numbers `--best` lays copies on (else the instance type's)
    goal: str = "throughput"
    explicit_tp: bool = False  # --tp given: `--best` tries only those degrees
    explicit_type: bool = False  # --instance-type given: `--best` lays copies on its cores


def parse(args: argparse.Namespace) -> Request:
    """Refuse bad input in one line (RequestError) before any model work."""
    model = args.model or _settings().model
    spec = spec_name(model, "--model" if args.model else "the configured model")
    loaded = load_spec(spec)
    shapes = [Resolution.parse(s) for s in args.shape] if args.shape else _settings().parsed_resolutions
    tps = [check_tp(loaded, tp) for tp in (args.tp or ["1"])]
    types: dict[str, str] = {}
    for name in getattr(args, "instance_type", None) or []:
        types[instance_type(name)[0]] = name.strip().lower()
    families = args.instance or list(types) or ["trn2"]
    found = [instance(name) for name in families]
    for inst in found:
        types.setdefault(inst.name, inst.default_instance_type)
    references = [_references(n) for n in (getattr(args, "references", None) or ["0"])]
    hbm = getattr(args, "hbm_gib", None)
    if hbm is not None and not 0 < hbm <= 1024:
        raise RequestError(f"--hbm-gib {hbm:g} is not a size in GiB (0 to 1024)", param="hbm_gib")
    setting = getattr(args, "placement", None) or "auto"
    if setting != "auto" and setting not in layout.SETTINGS:
        known = ", ".join(("auto", *layout.SETTINGS))
        raise RequestError(f"--placement {setting!r} is not a placement; one of: {known}", param="placement")
    cores = _cores_arg(getattr(args, "cores", None))
    goal = getattr(args, "goal", None) or "throughput"
    if goal not in GOALS:
        raise RequestError(f"--goal {goal!r} is not a goal; one of: {', '.join(GOALS)}", param="goal")
    uniq = _unique
    given = bool(getattr(args, "instance_type", None))
    return Request(
        model, spec, uniq(shapes), uniq(tps), uniq(found), uniq(references), types, hbm, setting, cores, goal,
        explicit_tp=bool(args.tp), explicit_type=given,
    )  # fmt: skip


def _cores_arg(value: str | None) -> list[int] | None:
    if value is None:
        return None
    from neuron_app.environment import parse_cores

    try:
        first, last = parse_cores(value)
    except ValueError as exc:
        raise RequestError(f"--cores {value!r}: {exc}", param="cores") from None
    return list(range(first, last + 1))


def _references(value: str) -> int:
    """An edit's reference count: 0 (text-to-image) to the app's most (max_references' bound)."""
    try:
        count = int(value)
    except ValueError:
        count = -1
    if not 0 <= count <= 8:
        raise RequestError(f"--references {value!r} is not a count of reference images (0 to 8)", param="references")
    return count


def _settings() -> Any:
    from neuron_app.settings import get_settings

    return get_settings()


def _unique(items: list[Any]) -> list[Any]:
    return list(dict.fromkeys(items))


def _gib(nbytes: float) -> float:
    return round(nbytes / GIB, 3)


def _seconds(measured: Any, inst: Instance) -> float:
    compute = measured.flops / (inst.bf16_tflops_per_core * 1e12)
    memory = measured.weight_bytes / inst.hbm_bytes_per_s_per_core
    return max(compute, memory)


def plan_one(
    spec: str,
    model: str,
    shape: Resolution,
    tp: int,
    inst: Instance,
    references: int = 0,
    type_name: str | None = None,
    hbm_gib: float | None = None,
    setting: str = "auto",
) -> dict[str, Any]:
    """One model x shape x TP x instance (x references), as the JSON object the command prints."""
    from neuron_app.engine.model.real import measure

    pipeline = load_spec(spec)["pipeline"]
    steps, tokens = pipeline["default_steps"], pipeline["max_sequence_length"]
    w, h = shape.width, shape.height
    measured = {
        "transformer": measure.transformer(spec, w, h, tp, tokens, references),
        "text_encoder": measure.text_encoder(spec, tokens),
        "vae": measure.vae(spec, w, h),
    }
    encode = measure.vae_encode(spec, w, h) if references else None
    if encode is not None and encode.activation_bytes > measured["vae"].activation_bytes:
        measured["vae"] = replace(measured["vae"], activation_bytes=encode.activation_bytes)
    whole_step = measure.transformer(spec, w, h, 1, tokens, references).flops
    placed = layout.place(measured, tp, inst, hbm_gib, setting)
    inst = placed["inst"]
    fullest = placed["fullest"]
    step_s = _seconds(measured["transformer"], inst)
    encodes_s = references * _seconds(encode, inst) if encode else 0.0
    floor = steps * step_s + _seconds(measured["text_encoder"], inst) + _seconds(measured["vae"], inst) + encodes_s
    total = round((fullest["weights"] + fullest["activations"]) / GIB + inst.reserve_gib_per_core, 3)
    encode_flops = references * encode.flops if encode else 0
    image_flops = steps * whole_step + measured["text_encoder"].flops + measured["vae"].flops + encode_flops
    return {
        "model": model,
        "spec": spec,
        "shape": str(shape),
        "references": references,
        "tp": tp,
        "instance": inst.name,
        "lnc": inst.lnc,
        "dtype": "bfloat16",
        "steps": steps,
        "text_tokens": tokens,
        "joint_tokens": (w // 16) * (h // 16) * (1 + references) + tokens,
        "components": {
            name: {
                "params": m.params,
                "weights_gib_per_core": _gib(m.weight_bytes),
                "activations_gib": _gib(m.activation_bytes),
                "tflop_per_call_per_core": round(m.flops / 1e12, 3),
            }
            for name, m in measured.items()
        },
        "activations_gib_per_core": _gib(fullest["activations"]),
        "runtime_reserve_gib_per_core": round(inst.reserve_gib_per_core, 3),
        "total_gib_per_core": total,
        "hbm_gib_per_core": inst.hbm_gib_per_core,
        "cores_per_bank": inst.cores_per_bank,
        "fits": placed["fits"],
        "placement": placed["placement"],
        "core_loads_gib": [round(g, 3) for g in placed["loads_gib"]],
        "instance_view": layout.instance_view(placed["loads_gib"], inst, floor, type_name, tp),
        "tflop_per_step": round(whole_step / 1e12, 3),
        "tflop_per_image": round(image_flops / 1e12, 3),
        "floor_s_per_step": round(step_s, 4),
        "floor_s_per_image": round(floor, 3),
        "peak_bf16_tflops_per_core": inst.bf16_tflops_per_core,
        "hbm_gb_per_s_per_core": round(inst.hbm_bytes_per_s_per_core / 1e9, 1),
    }


def plan(request: Request) -> list[dict[str, Any]]:
    return [
        plan_one(
            request.spec,
            request.model,
            shape,
            tp,
            inst,
            refs,
            request.instance_types.get(inst.name),
            request.hbm_gib,
            request.placement,
        )
        for shape in request.shapes
        for refs in request.references
        for tp in request.tps
        for inst in request.instances
    ]


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


def best_of(request: Request) -> dict[str, Any]:
    """`--best`: the topology for the request's model, shapes and first instance (its `--instance-type`, else
    `--cores`, else this host's cores)."""
    inst = request.instances[0]
    given = request.instance_types.get(inst.name) if request.explicit_type else None
    cores = request.cores or host_cores(inst, given)
    tps = request.tps if request.explicit_tp else None
    return best(
        request.spec, request.model, request.shapes, inst, cores, request.goal, tps, request.hbm_gib, request.placement
    )


def table(rows: list[dict[str, Any]]) -> list[list[Any]]:
    """The rows of the readable table (headers: HEADERS)."""
    return [
        [
            r["spec"],
            r["shape"] + (f" +{r['references']} ref" if r["references"] else ""),
            r["tp"],
            f"{r['instance']} LNC={r['lnc']}",
            "yes" if r["fits"] else "NO",
            f"{r['total_gib_per_core']:.1f} of {r['hbm_gib_per_core']:g}",
            f"{r['placement']['setting']} ({_cores(r['placement']['cores_used'])})",
            f"{r['tflop_per_step']:.1f}",
            f"{r['tflop_per_image']:.1f}",
            f"{r['floor_s_per_image']:.2f}",
            _view(r["instance_view"]),
        ]
        for r in rows
    ]


def topology_words(t: dict[str, Any]) -> str:
    """A topology in one line: "32 copies of TP 2 (together) on cores [0, 1], [2, 3], ...: 31.9 images/s ..." """
    shown = ", ".join(str(b) for b in t["core_blocks"][:4]) + (", ..." if len(t["core_blocks"]) > 4 else "")
    floor = f"{t['floor_s_per_image']:.3f} s per image" if t["floor_s_per_image"] else "no floor planned"
    rate = f"{t['images_per_s_floor']:g} images/s floor, " if t["images_per_s_floor"] is not None else ""
    copies = f"{t['copies']} cop{'y' if t['copies'] == 1 else 'ies'}"
    return f"{copies} of TP {t['tp']} ({t['placement']}) on cores {shown or '(none)'}: {rate}{floor}; {t['why']}"


def _cores(count: int) -> str:
    return f"{count} core" if count == 1 else f"{count} cores"


HEADERS = [
    "model",
    "shape",
    "tp",
    "instance",
    "fits",
    "GiB per core",
    "placement",
    "TFLOP/step",
    "TFLOP/image",
    "floor s/image",
    "instance: replicas, images/s floor",
]


def _view(view: dict[str, Any]) -> str:
    if view["instance_type"] is None:
        return "no EC2 size known"
    return f"{view['instance_type']}: {view['replicas']}, {view['images_per_s_floor']:g}/s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments (`python -m neuron_app plan --help`)."""
    parser.add_argument("--model", help="klein-4b, klein-9b (-random), or their Hub id (default: the configured model)")
    parser.add_argument("--shape", action="append", metavar="WxH", help="repeatable (default: configured resolutions)")
    parser.add_argument("--tp", action="append", metavar="N", help="tensor-parallel degree, repeatable (default 1)")
    parser.add_argument("--instance", action="append", metavar="trn1|trn2|trn3", help="repeatable (default trn2)")
    parser.add_argument(
        "--instance-type", action="append", metavar="TYPE", help="the EC2 size each row's instance_view counts "
        "(default the family's smallest: trn2.3xlarge); repeatable, one per family",
    )  # fmt: skip
    parser.add_argument("--references", action="append", metavar="N", help="rows for an edit with N references")
    parser.add_argument(
        "--placement", metavar="SETTING", help="plan this placement setting only (default auto: the first that fits)"
    )
    parser.add_argument("--hbm-gib", type=float, metavar="G", help="cores of G GiB (NEURON_EMULATOR_HBM_GIB)")
    parser.add_argument("--json", action="store_true", help="one object per model x shape x TP x instance")
    parser.add_argument(
        "--best", action="store_true", help="the topology auto serves: copies x TP x placement on aligned core blocks"
    )
    parser.add_argument("--goal", choices=GOALS, help="what --best maximises (default throughput)")
    parser.add_argument("--cores", metavar="N-M", help="--best lays copies on these cores (default: the instance's)")


def main_args(args: argparse.Namespace, render: Any) -> int:
    """The command: checked arguments, the measured plan, JSON or a table (`render(headers, rows)`)."""
    request = parse(args)
    if getattr(args, "best", False):
        found = best_of(request)
        if args.json:
            print(json.dumps({"topology": found}, indent=2))
        else:
            print(topology_words(found))
        return 0
    rows = plan(request)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(render(HEADERS, table(rows)))
    print(
        f"bfloat16, {rows[0]['steps']} steps, {rows[0]['text_tokens']} text tokens; measured on fake tensors "
        "(docs/real-size.md). floor: roofline at the instance's peak rate and HBM bandwidth per core"
    )
    if not all(r["fits"] for r in rows):
        print("NO: no placement the app serves fits (at TP > 1 only together is served); plan a higher --tp")
    return 0
