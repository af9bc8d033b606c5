"""The shipped model specs and instance figures: which names mean which architecture, read from specs/*.json.

Torch-free: the plan command checks its arguments against these before it imports anything heavy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from neuron_app.errors import RequestError

SPECS = Path(__file__).resolve().parent / "specs"

#: Every name `--model` accepts -> the spec it plans. The `-random` names are the same architectures (the plan reads
#: configs only; a random-weights pipeline of them is what NEURON_APP_MODEL would load, docs/real-size.md).
ALIASES: dict[str, str] = {
    "klein-4b": "klein-4b",
    "klein-4b-random": "klein-4b",
    "black-forest-labs/FLUX.2-klein-4B": "klein-4b",
    "klein-9b": "klein-9b",
    "klein-9b-random": "klein-9b",
    "black-forest-labs/FLUX.2-klein-9B": "klein-9b",
}

GIB = 2**30


@dataclass(frozen=True)
class Instance:
    """One Trainium generation at its default logical-core setting: per-core memory, peak rate and bandwidth."""

    name: str
    chip: str
    lnc: int
    cores_per_chip: int
    hbm_gib_per_core: float
    bf16_tflops_per_core: float
    hbm_bytes_per_s_per_core: float


def spec_name(model: str, given: str = "--model") -> str:
    """The spec a model name plans (`given`: where the name came from); refused in one line when it names none."""
    key = next((k for k in ALIASES if k.lower() == model.strip().lower()), None)
    if key is None:
        known = ", ".join(ALIASES)
        raise RequestError(f"{given} {model!r} is not a planned model; pass --model, one of: {known}", param="model")
    return ALIASES[key]


@cache
def load_spec(name: str) -> dict[str, Any]:
    """The shipped spec (configs of the transformer, text encoder, VAE, scheduler and the pipeline's defaults)."""
    return json.loads((SPECS / f"{name}.json").read_text())


def component_config(spec: dict[str, Any], component: str) -> dict[str, Any]:
    """A component's constructor arguments: the spec's entry without its `_`-prefixed notes."""
    return {k: v for k, v in spec[component].items() if not k.startswith("_")}


_BANDWIDTH_UNITS = {"GiB/s": GIB, "TB/s": 1e12, "GB/s": 1e9}


@cache
def instances() -> dict[str, Instance]:
    """trn1, trn2, trn3 from specs/instances.json, divided per logical core."""
    raw = json.loads((SPECS / "instances.json").read_text())
    found = {}
    for name, chip in raw.items():
        if name.startswith("_"):
            continue
        value, unit = chip["hbm_bandwidth_per_chip"]
        cores = chip["logical_cores_per_chip"]
        found[name] = Instance(
            name=name,
            chip=chip["chip"],
            lnc=chip["default_lnc"],
            cores_per_chip=cores,
            hbm_gib_per_core=chip["hbm_gib_per_chip"] / cores,
            bf16_tflops_per_core=chip["bf16_tflops_per_chip"] / cores,
            hbm_bytes_per_s_per_core=value * _BANDWIDTH_UNITS[unit] / cores,
        )
    return found


def instance(name: str) -> Instance:
    found = instances().get(name.strip().lower())
    if found is None:
        raise RequestError(f"--instance {name!r} is not known; one of: {', '.join(instances())}", param="instance")
    return found


def check_tp(spec: dict[str, Any], tp: str | int) -> int:
    """A TP degree the transformer can be sharded by: a positive integer that divides its attention heads (every
    block of diffusers' TP plan is a multiple of the head width, so this is the condition it checks too)."""
    try:
        value = int(tp)
    except (TypeError, ValueError):
        raise RequestError(f"--tp {tp!r} is not a whole number", param="tp") from None
    heads = spec["transformer"]["num_attention_heads"]
    if value < 1 or heads % value:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise RequestError(
            f"--tp {value} does not divide {spec['name']}'s {heads} attention heads; one of {divisors}", param="tp"
        )
    return value
