"""The process environment the Neuron stack reads once, exported before anything imports torch.

TorchNeuron is autoloaded by `import torch` and reads its NEFF cache folder and its fallback
switches from the environment then, so every entry (`app.py`, each torchrun rank, `python -m
neuron_app ...`, the bench workers) calls `prepare_process` first. This module is torch-free
and cheap: the page may come up before torch is imported.

A value the user set is respected and reported, never overwritten. What the app itself exported
is remembered in `_NEURON_APP_EXPORTED` (inherited by child processes), so a second call, or a
child with another cache folder, can tell the app's own values from the user's.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger(__name__)

NEFF_CACHE_VAR = "TORCH_NEURONX_NEFF_CACHE_DIR"
#: TorchNeuron's silent fallbacks and the values that turn them off (compiled mode re-runs a failing
#: graph eagerly; eager mode runs a failing op on the CPU): a server must see its failures.
FALLBACK_VARS = {
    "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION": "1",
    "TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS": "1",
}
VISIBLE_CORES_VAR = "NEURON_RT_VISIBLE_CORES"
MARK_VAR = "_NEURON_APP_EXPORTED"
#: NEURON_RT_VISIBLE_CORES takes one core index or an inclusive range.
CORES_PATTERN = re.compile(r"^(\d+)(?:-(\d+))?$")

Origin = Literal["app", "user", "unset"]


@dataclass(frozen=True)
class EnvValue:
    """One variable as this process left it: its value and who set it."""

    name: str
    value: str | None
    origin: Origin

    def describe(self) -> str:
        if self.value is None:
            return f"{self.name} unset"
        return f"{self.name}={self.value} ({'set by the app' if self.origin == 'app' else 'yours, kept'})"


def _exported() -> dict[str, str]:
    try:
        data = json.loads(os.environ.get(MARK_VAR, "{}"))
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def origin(name: str) -> Origin:
    """`app` when the value is the one this app exported, `user` when someone else set it."""
    value = os.environ.get(name)
    if value is None:
        return "unset"
    return "app" if _exported().get(name) == value else "user"


def current(name: str) -> EnvValue:
    return EnvValue(name, os.environ.get(name), origin(name))


def _export(name: str, value: str) -> EnvValue:
    os.environ[name] = value
    marks = _exported()
    marks[name] = value
    os.environ[MARK_VAR] = json.dumps(marks, sort_keys=True)
    return EnvValue(name, value, "app")


def set_unless_user(name: str, value: str) -> EnvValue:
    """Export `value` unless the user already set `name` (then keep theirs and say so)."""
    if origin(name) == "user":
        return current(name)
    return _export(name, value)


def parse_cores(text: str) -> tuple[int, int]:
    """`4-7` -> (4, 7), `3` -> (3, 3); ValueError with the accepted forms otherwise."""
    match = CORES_PATTERN.match(text.strip())
    if not match:
        raise ValueError(f"{text!r} is not a NeuronCore index or range: use N or N-M, e.g. 0-3")
    first, last = int(match.group(1)), int(match.group(2) or match.group(1))
    if last < first:
        raise ValueError(f"{text!r}: the range ends before it starts")
    return first, last


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def neff_cache_dir(cache_dir: Path) -> Path:
    """Where NEFFs go: the user's own TORCH_NEURONX_NEFF_CACHE_DIR, else `<cache_dir>/neff`."""
    if origin(NEFF_CACHE_VAR) == "user":
        return Path(os.environ[NEFF_CACHE_VAR]).expanduser()
    return cache_dir / "neff"


def prepare_process(settings: Any) -> list[EnvValue]:
    """Export what the Neuron stack reads before torch loads; returns every variable's final state.

    Raises `SettingsError` for a core reservation that cannot work (under torchrun, or against a
    different NEURON_RT_VISIBLE_CORES already in the environment).
    """
    from neuron_app.settings import SettingsError

    if "torch" in sys.modules:  # too late for TorchNeuron's import-time reads: say so loudly
        log.warning("torch was imported before the Neuron environment was exported; %s may be ignored", NEFF_CACHE_VAR)
    folder = settings.cache_dir / "neff"
    values = [set_unless_user(NEFF_CACHE_VAR, str(folder))]
    if values[0].origin == "app":
        folder.mkdir(parents=True, exist_ok=True)
    if settings.device in ("auto", "neuron"):
        values += [set_unless_user(name, value) for name, value in FALLBACK_VARS.items()]
    cores = settings.visible_cores
    if cores is not None:
        if launched_by_torchrun():
            raise SettingsError(
                f"visible_cores={cores} cannot be used under torchrun: TorchNeuron gives each rank one "
                f"NeuronCore from LOCAL_RANK; unset NEURON_APP_VISIBLE_CORES (and {VISIBLE_CORES_VAR})"
            )
        theirs = current(VISIBLE_CORES_VAR)
        if theirs.origin == "user" and theirs.value != cores:
            raise SettingsError(
                f"visible_cores={cores} but {VISIBLE_CORES_VAR}={theirs.value} is already set in the environment: "
                "unset one of them"
            )
        values.append(_export(VISIBLE_CORES_VAR, cores))
    else:
        values.append(current(VISIBLE_CORES_VAR))
    for value in values:
        if value.origin == "user":
            log.info("environment: %s", value.describe())
    return values


def fallback_state() -> str:
    """One line for the status panel: are TorchNeuron's silent fallbacks off, and who said so."""
    values = [current(name) for name in FALLBACK_VARS]
    off = all(v.value is not None and v.value.strip().lower() in ("1", "true") for v in values)
    owners = {v.origin for v in values}
    if off:
        return "off (set by the app)" if owners == {"app"} else "off (your setting)"
    shown = ", ".join(f"{v.name}={v.value if v.value is not None else 'unset'}" for v in values)
    return f"ON - failures may silently run eagerly or on the CPU ({shown})"
