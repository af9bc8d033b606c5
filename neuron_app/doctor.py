"""`python -m neuron_app doctor`: the first command to run on a new trn instance.

One verdict per check (ok / problem with its fix, or info), exit 0 only when serving on the device the settings
choose would work: the neuron device for `device = "neuron"`, or `auto` where TorchNeuron is installed or the
instance is a Trainium one; elsewhere (the quick start on a laptop: `auto` picks cpu) each Trainium check that
fails is a `note`, which does not fail the run. `--stack` checks the installed software only (no device, no
instance, no cache volume): what an image build can check, including that `torch_neuronx` really imports (in a
subprocess, so an unloadable wheel fails the build). Nothing here reaches the network, and torch is imported only
when a TorchNeuron package is installed (after the environment is exported, as the app does it); any failure
becomes a problem line, never a traceback. The installed software's checks are doctor_stack.py's.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from neuron_app.doctor_stack import (
    Check,
    check_compiler,
    check_python,
    check_sdk_import,
    check_sdk_release,
    check_torch,
    check_torch_neuronx,
)
from neuron_app.environment import PRODUCT_NAME
from neuron_app.errors import RequestError, SettingsError

SUPPORTED_INSTANCES = ("trn2", "trn3")
VOLATILE_FS = ("tmpfs", "ramfs", "overlay")
EXIT_OK, EXIT_PROBLEM = 0, 1


def check_device(torchneuron: bool) -> Check:
    """NeuronCores torch sees through the `neuron` device; imports torch only with TorchNeuron installed."""
    nodes = sorted(p.name for p in Path("/dev").glob("neuron[0-9]*"))
    devices = f"{len(nodes)} /dev/neuron* device(s)"
    if not torchneuron:
        return Check(
            "neuron device", "problem", f"not checked without TorchNeuron; {devices}", "install TorchNeuron first"
        )
    try:
        import importlib

        from neuron_app.backends.neuron import neuron_device_count
        from neuron_app.backends.neuron_sdk import SDK_MODULE

        importlib.import_module(SDK_MODULE)  # torch autoloads it; explicit where autoload is off
        count = neuron_device_count()
    except Exception as exc:  # the runtime or driver failing: one line, no traceback
        from neuron_app.errors import one_line

        return Check("neuron device", "problem", f"query failed: {one_line(exc)}; {devices}", _DEVICE_FIX)
    if count < 1:
        return Check("neuron device", "problem", f"torch sees no NeuronCore; {devices}", _DEVICE_FIX)
    return Check("neuron device", "ok", f"{count} NeuronCore(s) visible to torch; {devices}")


_DEVICE_FIX = (
    "run on a Trn2/Trn3 instance with the Neuron driver (aws-neuronx-dkms) loaded; in Docker pass "
    "--device=/dev/neuron0 (one per Neuron device); check that no other process holds the cores (neuron-ls, neuron-top)"
)


def check_cores(settings: Any) -> Check:
    from neuron_app.environment import VISIBLE_CORES_VAR, launched_by_torchrun, parse_cores

    value = os.environ.get(VISIBLE_CORES_VAR)
    if launched_by_torchrun() and value:
        return Check(
            "visible cores",
            "problem",
            f"{VISIBLE_CORES_VAR}={value} under torchrun",
            "unset it: TorchNeuron gives each torchrun rank one core from LOCAL_RANK",
        )
    if value is None:
        return Check("visible cores", "ok", "all cores this process can see (NEURON_RT_VISIBLE_CORES unset)")
    try:
        first, last = parse_cores(value)
    except ValueError as exc:
        return Check("visible cores", "problem", f"{VISIBLE_CORES_VAR}={value}", str(exc))
    return Check("visible cores", "ok", f"{VISIBLE_CORES_VAR}={value} ({last - first + 1} core(s) reserved)")


def read_instance_type(path: Path = PRODUCT_NAME) -> str | None:
    try:
        return path.read_text(errors="replace").strip() or None
    except OSError:
        return None


def check_instance(path: Path = PRODUCT_NAME) -> Check:
    found = read_instance_type(path)
    if found is None:
        return Check("instance", "info", f"unknown ({path} not readable)")
    family = found.split(".")[0].lower()
    if family.startswith(SUPPORTED_INSTANCES):
        return Check("instance", "ok", found)
    if family.startswith(("trn1", "inf1", "inf2")):
        return Check(
            "instance", "problem", found, "TorchNeuron runs on Trn2 and Trn3 only: launch a trn2 or trn3 instance"
        )
    return Check("instance", "problem", f"{found} (not a Trainium instance)", "launch a trn2 or trn3 instance")


def _mount_type(path: Path) -> str | None:
    """The filesystem type of the mount holding `path`, from /proc/mounts (longest matching mount point)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    best, fstype = "", None
    target = str(path.resolve())
    for line in mounts:
        parts = line.split()
        inside = len(parts) >= 3 and (target == parts[1] or target.startswith(parts[1].rstrip("/") + "/"))
        if inside and len(parts[1]) > len(best):
            best, fstype = parts[1], parts[2]
    return fstype


def check_cache(folder: Path, name: str, origin: str) -> Check:
    """Writable, and on storage that survives a reboot (not /tmp, not a tmpfs)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".doctor-"):
            pass
    except OSError as exc:
        return Check(name, "problem", f"{folder} not writable ({exc.strerror})", "choose a writable folder")
    fstype = _mount_type(folder)
    where = f"{folder} ({origin}, {fstype or 'unknown filesystem'})"
    resolved = str(folder.resolve())
    if resolved == "/tmp" or resolved.startswith("/tmp/") or fstype in ("tmpfs", "ramfs"):
        return Check(
            name,
            "problem",
            where,
            "wiped on reboot: every restart recompiles for minutes; point NEURON_APP_CACHE_DIR (or your "
            "TORCH_NEURONX_NEFF_CACHE_DIR) at a persistent volume (EBS, a Docker named volume)",
        )
    if fstype == "overlay":
        return Check(name, "problem", where, "a container's own layer is lost with the container: mount a volume there")
    return Check(name, "ok", where)


#: What stays a problem on any device: the settings, and torch itself.
ANY_DEVICE = ("settings", "torch")


def judged_device(settings: Any, neuronx_installed: bool) -> str:
    """The device the doctor judges: the configured one; `auto` is neuron where a torch-neuronx package is installed
    (even the wrong one) or the instance is a Trainium one (so a broken install there is still a problem), else cpu
    or cuda."""
    if settings.device != "auto":
        return settings.device
    family = (read_instance_type() or "").split(".")[0].lower()
    return "neuron" if neuronx_installed or family.startswith(SUPPORTED_INSTANCES) else "cpu or cuda (auto)"


def as_notes(checks: list[Check]) -> list[Check]:
    """Serving off Trainium: each Trainium check that fails becomes a note (its fix kept for the day it is)."""
    return [
        Check(c.name, "note", c.found, c.fix) if c.verdict == "problem" and c.name not in ANY_DEVICE else c
        for c in checks
    ]


def run_checks(stack_only: bool = False) -> list[Check]:
    from neuron_app.errors import SettingsError
    from neuron_app.settings import load_settings

    checks = [check_python()]
    neuronx_check, neuronx = check_torch_neuronx()
    checks += [neuronx_check, check_torch(neuronx), *check_compiler(), check_sdk_release()]
    try:
        settings = load_settings()
    except SettingsError as exc:
        return [*checks, Check("settings", "problem", str(exc), "fix the settings file or NEURON_APP_* variables")]
    from neuron_app.environment import NEFF_CACHE_VAR, fallback_state, neff_cache_dir, origin, prepare_process

    try:
        prepare_process(settings)  # as the app does it, before torch is imported below
    except SettingsError as exc:
        checks.append(Check("settings", "problem", str(exc), "fix the core reservation"))
    state = fallback_state()
    checks.append(
        Check("fallback", "ok", state)
        if not state.startswith("ON")
        else Check(
            "fallback",
            "problem",
            state,
            "unset them (the app then sets both to 1) so that a failed compile marks its shape failed",
        )
    )
    checks.append(check_cores(settings))
    if neuronx is not None:  # after prepare_process: the probe imports with the app's environment
        checks.append(check_sdk_import())
    if not stack_only:
        checks.append(check_instance())
        checks.append(check_device(neuronx is not None))
        who = "your TORCH_NEURONX_NEFF_CACHE_DIR" if origin(NEFF_CACHE_VAR) == "user" else "set by the app"
        checks.append(check_cache(neff_cache_dir(settings.cache_dir), "NEFF cache", who))
        checks.append(check_plan(settings))
    device = "neuron" if stack_only else judged_device(settings, neuronx_check.found != "absent")
    if device == "neuron":
        return checks
    return [*as_notes(checks), Check("device", "ok", f"{device}: device = {settings.device} in the settings")]


def check_plan(settings: Any) -> Check:
    """The topology the app would serve (scale/topology.py): the plan for the served model, shapes, TP and placement
    on this instance (trn2 when not one) at its LNC, laid out on the cores this process holds (V4: a placement that
    needs 2 cores is a problem with 1), before any compile."""
    from neuron_app.engine.model.real.best import topology_words
    from neuron_app.engine.model.real.served import planned
    from neuron_app.scale.topology import choose, held_cores

    if planned(settings.model) is None:
        return Check("plan", "info", f"{settings.model}: not a model the plan knows (python -m neuron_app plan)")
    try:  # RequestError: a NEURON_LOGICAL_NC_CONFIG the chip does not take; SettingsError: it does not fit
        found = choose(settings, held_cores(settings, "neuron"), in_process=True)  # doctor holds no core
    except RequestError as exc:
        return Check("plan", "problem", str(exc), "set NEURON_LOGICAL_NC_CONFIG to 1 or 2 (2 is the default)")
    except SettingsError as exc:
        return Check("plan", "problem", f"{settings.model}: {exc}", "python -m neuron_app plan --best shows what fits")
    return Check("plan", "ok", f"{settings.model}: {topology_words(found.view())}")


def render(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.name.ljust(width)}  {c.verdict:<7}  {c.found}")
        if c.fix:
            lines.append(f"{' ' * width}  {'':<7}  fix: {c.fix}")
    problems = [c for c in checks if c.verdict == "problem"]
    notes = [c.name for c in checks if c.verdict == "note"]
    device = next((c.found.split(":")[0] for c in checks if c.name == "device"), "the neuron device")
    if problems:
        lines.append(
            f"verdict: {len(problems)} problem(s) ({', '.join(c.name for c in problems)}): "
            f"serving on {device} would not work here"
        )
    else:
        lines.append(f"verdict: ok, serving on {device} should work here")
    if notes:
        lines.append(
            f"notes: {len(notes)} check(s) for Trainium ({', '.join(notes)}) do not pass here; they matter only "
            "for device = neuron (set NEURON_APP_DEVICE=neuron to judge them)"
        )
    return "\n".join(lines)


def run_doctor(stack_only: bool = False, as_json: bool = False) -> int:
    checks = run_checks(stack_only)
    ok = not any(c.verdict == "problem" for c in checks)
    if as_json:
        print(json.dumps({"ok": ok, "stack_only": stack_only, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        print(render(checks))
    return EXIT_OK if ok else EXIT_PROBLEM
