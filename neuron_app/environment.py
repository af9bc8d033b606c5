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

import hashlib
import json
import logging
import os
import re
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Literal

from neuron_app.errors import SettingsError

log = logging.getLogger(__name__)

NEFF_CACHE_VAR = "TORCH_NEURONX_NEFF_CACHE_DIR"
#: TorchNeuron's silent fallbacks and the values that turn them off (compiled mode re-runs a failing
#: graph eagerly; eager mode runs a failing op on the CPU): a server must see its failures.
FALLBACK_VARS = {
    "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION": "1",
    "TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS": "1",
}
VISIBLE_CORES_VAR = "NEURON_RT_VISIBLE_CORES"
#: What a NEFF depends on beyond its graph (the NEFF folder's key, T12): the SDK's packages, the compiler flags, the
#: logical-core setting and how SDPA is lowered.
NEFF_KEY_DISTS = ("torch-neuronx", "neuronx-cc", "nki", "torch")
NEFF_KEY_VARS = ("NEURON_CC_FLAGS", "NEURON_LOGICAL_NC_CONFIG", "TORCH_NEURONX_ENABLE_NKI_SDPA")
MARK_VAR = "_NEURON_APP_EXPORTED"
#: The chip a NEFF is compiled for is part of the folder's name (U10): the Neuron stack's own override, else the
#: instance family from the type EC2 Nitro instances expose without a network call (IMDS is not used: it can hang).
PLATFORM_TARGET_VAR = "NEURON_PLATFORM_TARGET_OVERRIDE"
PRODUCT_NAME = Path("/sys/devices/virtual/dmi/id/product_name")
#: One item of NEURON_RT_VISIBLE_CORES: a core index or an inclusive range. The runtime takes a comma list of
#: items (`3,4,5,6`, `3-6`, `3-5,6`; Ray writes comma lists) whose cores form one contiguous range.
CORES_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")

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
    """The runtime's grammar: `4-7` -> (4, 7), `3` -> (3, 3), `3,4,5,6` and `3-5,6` -> (3, 6).

    ValueError naming the accepted forms otherwise: the runtime needs one contiguous range, so a gap
    (`0,2`) or a core listed twice is refused here rather than by the runtime at model load.
    """
    forms = "use N, N-M or a comma list of them covering one contiguous range, e.g. 0-3 or 3-5,6"
    cores: list[int] = []
    for item in text.strip().split(","):
        match = CORES_ITEM.match(item.strip())
        if not match:
            raise ValueError(f"{text!r} is not a NeuronCore index, range or list: {forms}")
        first, last = int(match.group(1)), int(match.group(2) or match.group(1))
        if last < first:
            raise ValueError(f"{text!r}: the range {item.strip()} ends before it starts")
        cores.extend(range(first, last + 1))
    unique = sorted(set(cores))
    if len(unique) != len(cores):
        twice = sorted({c for c in cores if cores.count(c) > 1})
        raise ValueError(f"{text!r} lists core(s) {', '.join(map(str, twice))} more than once")
    if unique[-1] - unique[0] + 1 != len(unique):
        missing = sorted(set(range(unique[0], unique[-1] + 1)) - set(unique))
        raise ValueError(
            f"{text!r} is not contiguous (core(s) {', '.join(map(str, missing))} missing): the Neuron runtime "
            f"needs one contiguous range; {forms}"
        )
    return unique[0], unique[-1]


def _one_core(value: str) -> bool:
    try:
        first, last = parse_cores(value)
    except ValueError:
        return False
    return first == last


def _same_cores(value: str | None, cores: str) -> bool:
    """Two spellings of one reservation (`3,4,5,6` and `3-6`) are the same; an unparsable value is not."""
    try:
        return value is not None and parse_cores(value) == parse_cores(cores)
    except ValueError:
        return False


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def dist_version(name: str) -> str | None:
    """An installed distribution's version (package metadata: nothing is imported), None when it is absent."""
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def platform_target(product_name: Path = PRODUCT_NAME) -> str:
    """The chip this host compiles NEFFs for (`trn2`, `trn3`): NEURON_PLATFORM_TARGET_OVERRIDE when set, else the
    instance's family (`trn2.48xlarge`, `trn2u.48xlarge` -> trn2), else `unknown` (not a Trainium host). Torch-free:
    the NEFF folder is named before torch loads."""
    override = os.environ.get(PLATFORM_TARGET_VAR, "").strip().lower()
    if override:
        return re.sub(r"[^a-z0-9]+", "-", override)
    try:
        family = product_name.read_text(errors="replace").strip().split(".")[0].lower()
    except OSError:
        return "unknown"
    match = re.match(r"(trn\d+|inf\d+)", family)
    return match.group(1) if match else "unknown"


def neff_key() -> str:
    """The NEFF folder's name for this SDK, these flags and this chip (T12, U10): whether TorchNeuron's own disk key
    covers the compiler's version, NEURON_CC_FLAGS and the target is unconfirmed, so NEFFs of another release,
    flag set or chip (a cache shared by a trn2 and a trn3 fleet) never meet."""
    found = {name: dist_version(name) or "absent" for name in NEFF_KEY_DISTS}
    found |= {name: os.environ.get(name, "") for name in NEFF_KEY_VARS}
    found["platform_target"] = platform_target()
    digest = hashlib.sha256(json.dumps(found, sort_keys=True).encode()).hexdigest()[:12]
    return f"torch-neuronx-{found['torch-neuronx']}-{found['platform_target']}-{digest}"


def neff_cache_dir(cache_dir: Path) -> Path:
    """Where NEFFs go: the user's own TORCH_NEURONX_NEFF_CACHE_DIR, else `<cache_dir>/neff/<neff_key()>`."""
    if origin(NEFF_CACHE_VAR) == "user":
        return Path(os.environ[NEFF_CACHE_VAR]).expanduser()
    return cache_dir / "neff" / neff_key()


def prepare_process(settings: Any) -> list[EnvValue]:
    """Export what the Neuron stack reads before torch loads; returns every variable's final state.

    Raises `SettingsError` for a core reservation that cannot work (any reservation under torchrun, or
    one against a different NEURON_RT_VISIBLE_CORES already in the environment).
    """
    if "torch" in sys.modules:  # too late for TorchNeuron's import-time reads: say so loudly
        log.warning("torch was imported before the Neuron environment was exported; %s may be ignored", NEFF_CACHE_VAR)
    folder = neff_cache_dir(settings.cache_dir)  # the user's own folder is kept as it is
    values = [set_unless_user(NEFF_CACHE_VAR, str(folder))]
    if values[0].origin == "app":
        folder.mkdir(parents=True, exist_ok=True)
    if settings.device in ("auto", "neuron", "neuron-emulated"):
        values += [set_unless_user(name, value) for name, value in FALLBACK_VARS.items()]
    cores = settings.visible_cores
    theirs = current(VISIBLE_CORES_VAR)
    if launched_by_torchrun() and theirs.value is not None and not _one_core(theirs.value):
        # A rank holds exactly one core (TorchNeuron asserts it): its own, which the topology exports per rank
        # (scale/topology.py rank_env); a range trips the one-device-per-rank assert.
        raise SettingsError(
            f"{VISIBLE_CORES_VAR}={theirs.value} cannot be used under torchrun: a rank holds exactly one NeuronCore "
            f"(the app exports each rank's own from the topology); unset {VISIBLE_CORES_VAR} or name the cores "
            "with NEURON_APP_VISIBLE_CORES"
        )
    if cores is not None:
        if launched_by_torchrun() and not _one_core(cores):
            raise SettingsError(
                f"visible_cores={cores} reached a torchrun rank: a rank holds exactly one NeuronCore, its own "
                "core of the topology's block (scale/topology.py); this is the app's error, please report it"
            )
        if theirs.origin == "user" and not _same_cores(theirs.value, cores):
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


def forwarded_env() -> dict[str, str]:
    """What a Ray replica on another node must see as this process left it: the NEFF cache folder, the
    fallback switches and the marker of who set them (`runtime_env` env vars). A replica on a joined
    cluster descends from `ray start` on its own node, not from this process, so it inherits none of
    them. Never NEURON_RT_VISIBLE_CORES: Ray sets it for each replica."""
    names = [NEFF_CACHE_VAR, *FALLBACK_VARS]
    env = {name: os.environ[name] for name in names if name in os.environ}
    marks = {name: value for name, value in _exported().items() if name in names}
    if marks:
        env[MARK_VAR] = json.dumps(marks, sort_keys=True)
    return env


def fallback_state(fallen_back: list[str] | None = None) -> str:
    """One line for the status panel: are TorchNeuron's silent fallbacks off, who said so, and what still fell
    back: with both switches set, failing graphs and failing ops raise, but ops TorchNeuron does not implement
    still run on the CPU (`get_fallback_ops()` lists them)."""
    values = [current(name) for name in FALLBACK_VARS]
    off = all(v.value is not None and v.value.strip().lower() in ("1", "true") for v in values)
    owners = {v.origin for v in values}
    ops = sorted(set(fallen_back or []))  # get_fallback_ops() lists invocations: name each op once
    unimplemented = (
        f"{len(ops)} unimplemented op(s) ran on the CPU: {', '.join(ops[:5])}{' ...' if len(ops) > 5 else ''}"
        if ops
        else "no op has fallen back to the CPU so far (unimplemented ops would)"
    )
    if off:
        who = "set by the app" if owners == {"app"} else "your setting"
        return f"execution-error fallback off ({who}); {unimplemented}"
    shown = ", ".join(f"{v.name}={v.value if v.value is not None else 'unset'}" for v in values)
    return f"ON - failures may silently run eagerly or on the CPU ({shown}); {unimplemented}"
