"""`python -m neuron_app plan`: before any compile, what fits on which NeuronCores and the fastest an image can be.

For each model x shape x TP x instance, from the fake-tensor measurements (measure.py) and the instance's published
figures (specs/instances.json, cited in docs/real-size.md):
- memory per core: weights of the components a core holds plus the largest activation peak among them (they run
  one after another); the transformer at its TP shard;
- a placement: everything on each TP core if it fits, else the text encoder on a core of its own, else the VAE too;
- a roofline floor per image: each call takes at least max(FLOPs / peak bfloat16 rate, weight bytes / HBM
  bandwidth) of one core (weights read once per call; collectives and activation traffic left out: a lower bound).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_app.engine.model.real.catalog import GIB, Instance, check_tp, instance, load_spec, spec_name
from neuron_app.shapes import Resolution

COMPONENTS = ("transformer", "text_encoder", "vae")

#: Tried in order: the first whose every core fits is the plan. Each entry: what the TP cores hold, and the
#: components given a core of their own.
PLACEMENTS: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    ("together", ("transformer", "text_encoder", "vae"), ()),
    ("text encoder on its own core", ("transformer", "vae"), ("text_encoder",)),
    ("text encoder and VAE on their own cores", ("transformer",), ("text_encoder", "vae")),
]


@dataclass(frozen=True)
class Request:
    """Checked arguments: nothing heavy is imported until every one of them is valid."""

    model: str
    spec: str
    shapes: list[Resolution]
    tps: list[int]
    instances: list[Instance]


def parse(args: argparse.Namespace) -> Request:
    """Refuse bad input in one line (RequestError) before any model work."""
    model = args.model or _settings().model
    spec = spec_name(model, "--model" if args.model else "the configured model")
    loaded = load_spec(spec)
    shapes = [Resolution.parse(s) for s in args.shape] if args.shape else _settings().parsed_resolutions
    tps = [check_tp(loaded, tp) for tp in (args.tp or ["1"])]
    found = [instance(name) for name in (args.instance or ["trn2"])]
    return Request(model, spec, _unique(shapes), _unique(tps), _unique(found))


def _settings() -> Any:
    from neuron_app.settings import get_settings

    return get_settings()


def _unique(items: list[Any]) -> list[Any]:
    return list(dict.fromkeys(items))


def _gib(nbytes: float) -> float:
    return round(nbytes / GIB, 3)


def _core(held: tuple[str, ...], measured: dict[str, Any]) -> dict[str, Any]:
    weights = sum(measured[c].weight_bytes for c in held)
    activations = max(measured[c].activation_bytes for c in held)
    return {"holds": list(held), "weights": weights, "activations": activations, "total": weights + activations}


def place(measured: dict[str, Any], tp: int, hbm_gib: float) -> dict[str, Any]:
    """The first placement whose fullest core fits `hbm_gib`; else the last one (the least per core), not fitting."""
    for name, shared, own in PLACEMENTS:
        cores = [_core(shared, measured)] + [_core((c,), measured) for c in own]
        fullest = max(cores, key=lambda core: core["total"])
        if fullest["total"] <= hbm_gib * GIB or name == PLACEMENTS[-1][0]:
            break
    per_core = [
        {"cores": tp if i == 0 else 1, "holds": core["holds"], "gib": _gib(core["total"])}
        for i, core in enumerate(cores)
    ]
    return {"name": name, "cores_used": tp + len(own), "cores": per_core, "fullest": fullest}


def _seconds(measured: Any, inst: Instance) -> float:
    compute = measured.flops / (inst.bf16_tflops_per_core * 1e12)
    memory = measured.weight_bytes / inst.hbm_bytes_per_s_per_core
    return max(compute, memory)


def plan_one(spec: str, model: str, shape: Resolution, tp: int, inst: Instance) -> dict[str, Any]:
    """One model x shape x TP x instance, as the JSON object the command prints."""
    from neuron_app.engine.model.real import measure

    pipeline = load_spec(spec)["pipeline"]
    steps, tokens = pipeline["default_steps"], pipeline["max_sequence_length"]
    measured = {
        "transformer": measure.transformer(spec, shape.width, shape.height, tp, tokens),
        "text_encoder": measure.text_encoder(spec, tokens),
        "vae": measure.vae(spec, shape.width, shape.height),
    }
    whole_step = measure.transformer(spec, shape.width, shape.height, 1, tokens).flops
    placement = place(measured, tp, inst.hbm_gib_per_core)
    fullest = placement.pop("fullest")
    step_s = _seconds(measured["transformer"], inst)
    floor = steps * step_s + _seconds(measured["text_encoder"], inst) + _seconds(measured["vae"], inst)
    total = _gib(fullest["total"])
    image_flops = steps * whole_step + measured["text_encoder"].flops + measured["vae"].flops
    return {
        "model": model,
        "spec": spec,
        "shape": str(shape),
        "tp": tp,
        "instance": inst.name,
        "dtype": "bfloat16",
        "steps": steps,
        "text_tokens": tokens,
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
        "total_gib_per_core": total,
        "hbm_gib_per_core": inst.hbm_gib_per_core,
        "fits": total <= inst.hbm_gib_per_core,
        "placement": placement,
        "tflop_per_step": round(whole_step / 1e12, 3),
        "tflop_per_image": round(image_flops / 1e12, 3),
        "floor_s_per_step": round(step_s, 4),
        "floor_s_per_image": round(floor, 3),
        "peak_bf16_tflops_per_core": inst.bf16_tflops_per_core,
        "hbm_gb_per_s_per_core": round(inst.hbm_bytes_per_s_per_core / 1e9, 1),
    }


def plan(request: Request) -> list[dict[str, Any]]:
    return [
        plan_one(request.spec, request.model, shape, tp, inst)
        for shape in request.shapes
        for tp in request.tps
        for inst in request.instances
    ]


def table(rows: list[dict[str, Any]]) -> list[list[Any]]:
    """The rows of the readable table (headers: HEADERS)."""
    return [
        [
            r["spec"],
            r["shape"],
            r["tp"],
            r["instance"],
            "yes" if r["fits"] else "NO",
            f"{r['total_gib_per_core']:.1f} of {r['hbm_gib_per_core']:g}",
            f"{r['placement']['name']} ({_cores(r['placement']['cores_used'])})",
            f"{r['tflop_per_step']:.1f}",
            f"{r['tflop_per_image']:.1f}",
            f"{r['floor_s_per_image']:.2f}",
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
]


def main_args(args: argparse.Namespace, render: Any) -> int:
    """The command: checked arguments, the measured plan, JSON or a table (`render(headers, rows)`)."""
    request = parse(args)
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
        print("NO: not even the text encoder and the VAE on cores of their own fit; plan a higher --tp")
    return 0


def served(model: str, resolutions: list[str], tp: int, family: str) -> tuple[bool, str] | None:
    """What the served model needs per core at each configured shape on this instance family, before any compile
    (`doctor`): (every shape fits, "1024x1024: fits, 14.7 of 24 GiB per core, floor 0.92 s per image; ...").
    None when the model is not one the plan knows (a tiny model, a folder)."""
    from neuron_app.engine.model.real.catalog import ALIASES, instance
    from neuron_app.shapes import Resolution

    spec = next((v for k, v in ALIASES.items() if k.lower() == model.strip().lower()), None)
    if spec is None:
        return None
    inst = instance(family)
    rows = [plan_one(spec, model, Resolution.parse(shape), tp, inst) for shape in resolutions]
    return all(r["fits"] for r in rows), f"{model} on {family} at TP {tp}: " + "; ".join(_words(r) for r in rows)


def _words(r: dict[str, Any]) -> str:
    """One planned shape in words: "1024x1024: fits, 14.7 of 24 GiB per core (together), floor 0.92 s per image"."""
    return (
        f"{r['shape']}: {'fits' if r['fits'] else 'does NOT fit'}, {r['total_gib_per_core']:.1f} of "
        f"{r['hbm_gib_per_core']:g} GiB per core ({r['placement']['name']}), floor {r['floor_s_per_image']:.2f} s "
        "per image"
    )


class PlanLine:
    """The page's status line of `plan` for the served model (trn2, the configured shapes and TP): measured once,
    on a thread of its own (seconds of CPU on fake tensors), never on a status read; None until then, and for a
    model the plan does not know."""

    def __init__(self, model: str, resolutions: list[str], tp: int) -> None:
        import threading

        from neuron_app.engine.model.real.catalog import ALIASES

        self._text: str | None = None
        self._args = (model, resolutions, tp)
        self._started = threading.Event()
        self.done = threading.Event()  # measured (or given up): the status carries the line from now on
        self.planned = any(k.lower() == model.strip().lower() for k in ALIASES)

    def text(self) -> str | None:
        if self.planned and not self._started.is_set():
            import threading

            self._started.set()
            threading.Thread(target=self._measure, name="plan-line", daemon=True).start()
        return self._text

    def _measure(self) -> None:
        """`python -m neuron_app plan --json` in a process of its own: the measurement sets torch's process-wide
        default dtype and holds the CPU for seconds, neither of which the serving process should share."""
        import subprocess
        import sys

        model, resolutions, tp = self._args
        command = [sys.executable, "-m", "neuron_app", "plan", "--model", model, "--tp", str(tp), "--instance", "trn2"]
        command += [word for shape in resolutions for word in ("--shape", shape)] + ["--json"]
        try:
            root = Path(__file__).resolve().parents[4]  # where `neuron_app` imports from, whatever the cwd
            done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True, cwd=root)
            rows = json.loads(done.stdout)
            self._text = "; ".join(_words(r) for r in rows)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:  # a status line, never a server failure
            self._text = f"not measured ({type(exc).__name__})"
        finally:
            self.done.set()
