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

One row is fit.py's (`plan_one`); `--best`'s topology is best.py's; this module is the command: arguments, rows, table.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from neuron_app.engine.model.real import layout
from neuron_app.engine.model.real.best import GOALS, best, host_cores, topology_words
from neuron_app.engine.model.real.catalog import Instance, check_tp, instance, instance_type, load_spec, spec_name
from neuron_app.engine.model.real.fit import plan_one
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
