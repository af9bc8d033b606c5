"""The shipped model specs and instance figures: which names mean which architecture, read from specs/*.json.

Torch-free: the plan command checks its arguments against these before it imports anything heavy.
"""

from __future__ import annotations

import json
import os
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


#: The runtime's logical-core setting (AWS, logical NeuronCore configuration): read as the runtime reads it.
LNC_VAR = "NEURON_LOGICAL_NC_CONFIG"

#: Per physical NeuronCore, the runtime's micro-code (AWS, Neuron runtime device memory: "micro-code overhead of 96MB
#: per physical Neuron Core"): a logical core of LNC physical cores holds LNC times that before any tensor.
RUNTIME_MIB_PER_PHYSICAL_CORE = 96


@dataclass(frozen=True)
class Instance:
    """One Trainium generation at a logical-core setting: per-core rate and bandwidth, and the HBM banks the cores
    share (at LNC=1 on Trainium2 two logical cores share one 24 GB bank; at LNC=2 a logical core owns its bank)."""

    name: str
    chip: str
    lnc: int
    cores_per_chip: int  # logical
    bank_gib: float
    cores_per_bank: int  # logical cores drawing on one bank
    bf16_tflops_per_core: float
    hbm_bytes_per_s_per_core: float
    default_instance_type: str | None

    @property
    def hbm_gib_per_core(self) -> float:
        """What one core can address: its bank (shared with `cores_per_bank - 1` neighbours)."""
        return self.bank_gib

    @property
    def reserve_gib_per_core(self) -> float:
        """The runtime's own memory per logical core (micro-code), counted in `fits`."""
        return self.lnc * RUNTIME_MIB_PER_PHYSICAL_CORE / 1024


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
def _raw() -> dict[str, Any]:
    return json.loads((SPECS / "instances.json").read_text())


def families() -> list[str]:
    return [name for name in _raw() if not name.startswith("_") and name != "instance_types"]


def instance_types() -> dict[str, tuple[str, int]]:
    """EC2 size -> (family, chips)."""
    return {name: (family, chips) for name, (family, chips) in _raw()["instance_types"].items()}


def read_lnc(family: str, value: str | None = None) -> int:
    """The logical-core setting for `family`: NEURON_LOGICAL_NC_CONFIG (or `value`), else the family's default;
    a value the chip does not take is refused in one line."""
    chip = _raw()[family]
    text = os.environ.get(LNC_VAR, "") if value is None else value
    if not text.strip():
        return chip["default_lnc"]
    try:
        lnc = int(text)
    except ValueError:
        lnc = -1
    if lnc not in chip["lnc_values"]:
        allowed = " or ".join(str(v) for v in chip["lnc_values"])
        raise RequestError(f"{LNC_VAR}={text} is not a setting {family} takes ({allowed})", param="lnc")
    return lnc


def instance(name: str, lnc: int | None = None) -> Instance:
    """A family (trn1, trn2, trn3) per logical core at `lnc` (default: as the runtime reads it)."""
    family = name.strip().lower()
    if family not in families():
        raise RequestError(f"--instance {name!r} is not known; one of: {', '.join(families())}", param="instance")
    chip = _raw()[family]
    lnc = read_lnc(family) if lnc is None else lnc
    cores = chip["physical_cores_per_chip"] // lnc
    banks = chip["hbm_banks_per_chip"]
    value, unit = chip["hbm_bandwidth_per_chip"]
    return Instance(
        name=family,
        chip=chip["chip"],
        lnc=lnc,
        cores_per_chip=cores,
        bank_gib=chip["hbm_gib_per_chip"] / banks,
        cores_per_bank=max(1, cores // banks),
        bf16_tflops_per_core=chip["bf16_tflops_per_chip"] / cores,
        hbm_bytes_per_s_per_core=value * _BANDWIDTH_UNITS[unit] / cores,
        default_instance_type=chip["default_instance_type"],
    )


def instance_type(name: str) -> tuple[str, int]:
    """(family, chips) of an EC2 size, refused in one line when unknown."""
    found = instance_types().get(name.strip().lower())
    if found is None:
        known = ", ".join(instance_types())
        raise RequestError(f"--instance-type {name!r} is not known; one of: {known}", param="instance_type")
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
