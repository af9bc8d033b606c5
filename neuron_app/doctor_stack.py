"""The doctor's checks of the installed software (`doctor --stack`, what an image build can check): Python,
torch-neuronx and its torch, the compiler, the Neuron release, and that `torch_neuronx` really imports (in a
subprocess, so an unloadable wheel fails the build). Nothing here reaches the network; torch is imported only
in that subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from neuron_app.environment import dist_version

Verdict = Literal["ok", "problem", "info", "note"]

SUPPORTED_PYTHON = ((3, 12), (3, 14))
#: How long `import torch_neuronx` may take in its own process (torch alone takes seconds on a slow disk).
IMPORT_TIMEOUT_S = 180.0
#: Run in a fresh interpreter: a wheel that cannot load (a glibc or Python it was not built for, a missing
#: libnrt) fails there, with the app's environment, and cannot take the doctor down with it.
IMPORT_PROBE = (
    "import json, torch, torch_neuronx; "
    "print('NEURON_IMPORT ' + json.dumps({'torch': torch.__version__, 'neuron': hasattr(torch, 'neuron')}))"
)


@dataclass
class Check:
    name: str
    verdict: Verdict
    found: str
    fix: str = ""


def check_python() -> Check:
    found = sys.version.split()[0]
    low, high = SUPPORTED_PYTHON
    if low <= sys.version_info[:2] <= high:
        return Check("python", "ok", found)
    return Check(
        "python",
        "problem",
        found,
        "TorchNeuron ships for Python 3.12-3.14: use Ubuntu 26.04's (or, with Neuron 2.34, 24.04's) python3 venv "
        "(scripts/install-neuron.sh), the Neuron DLAMI's TorchNeuron venv or this project's Docker image",
    )


def check_torch_neuronx() -> tuple[Check, str | None]:
    from neuron_app.backends.neuron_sdk import INSTALL_HINT, XLA_FIX, installed_version, sdk_kind

    found = installed_version()
    kind = sdk_kind(found)
    if kind == "torchneuron":
        return Check("torch-neuronx", "ok", f"{found} (TorchNeuron)"), found
    if kind == "xla":
        return Check("torch-neuronx", "problem", f"{found} (PyTorch/XLA package)", XLA_FIX.format(found=found)), None
    return Check("torch-neuronx", "problem", "absent", INSTALL_HINT), None


def check_torch(neuronx: str | None) -> Check:
    found = dist_version("torch")
    if found is None:
        return Check(
            "torch", "problem", "absent", "install torch==2.13.0 with torch-neuronx==2.13.* (or 2.14.0 with 2.14.*)"
        )
    from neuron_app.backends.neuron_sdk import TORCHNEURON_FROM, release_family

    released = neuronx is not None and (release_family(neuronx) or (0, 0)) >= TORCHNEURON_FROM
    if neuronx is not None and not released:  # a source build's version (0.1.0) says nothing about its torch
        return Check("torch", "ok", f"{found} (torch-neuronx {neuronx} is a source build: not matched by version)")
    if neuronx is not None:
        family = ".".join(neuronx.split(".")[:2])
        if ".".join(found.split("+")[0].split(".")[:2]) != family:
            return Check(
                "torch",
                "problem",
                found,
                f"torch-neuronx {neuronx} needs torch {family}.*: install the matching pair (torch==2.13.0 with "
                "torch-neuronx==2.13.*, or torch==2.14.0 with torch-neuronx==2.14.*)",
            )
    return Check("torch", "ok", found)


def check_sdk_import(timeout_s: float = IMPORT_TIMEOUT_S) -> Check:
    """`import torch_neuronx` in a subprocess: package metadata says a wheel is installed, not that it loads.

    Import alone does not start the Neuron runtime (TorchNeuron defers it), so this runs in `docker build`.
    """
    name = "import torch_neuronx"
    fix = (
        "the installed wheel does not load here: TorchNeuron wheels are built for Ubuntu 26.04 (2.33 and 2.34; "
        "2.34 also for 24.04, unconfirmed) and Python 3.12-3.14; use the Docker image (ubuntu:26.04), the Neuron "
        "DLAMI's TorchNeuron venv or scripts/install-neuron.sh on Ubuntu 26.04 (docs/deploy-trn.md)"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", IMPORT_PROBE],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return Check(name, "problem", f"did not finish in {timeout_s:g} s", fix)
    except OSError as exc:
        return Check(name, "problem", f"could not start {sys.executable}: {exc.strerror}", fix)
    line = next((x for x in done.stdout.splitlines() if x.startswith("NEURON_IMPORT ")), None)
    if done.returncode != 0 or line is None:
        errors = [x.strip() for x in done.stderr.splitlines() if x.strip()]
        last = errors[-1] if errors else f"exit code {done.returncode}, no error printed"
        return Check(name, "problem", f"failed: {last[:300]}", fix)
    seen = json.loads(line.removeprefix("NEURON_IMPORT "))
    if not seen.get("neuron"):
        return Check(
            name,
            "problem",
            f"imported, but torch {seen.get('torch')} has no 'neuron' device module",
            "this is not TorchNeuron (the PyTorch/XLA package registers no 'neuron' device): install "
            "torch-neuronx 2.13.* or 2.14.* from Neuron SDK 2.34 (or 2.33)",
        )
    return Check(name, "ok", f"loads with torch {seen.get('torch')} (torch.neuron present)")


def check_compiler() -> list[Check]:
    cc = dist_version("neuronx-cc")
    checks = [
        Check("neuronx-cc", "ok", cc)
        if cc
        else Check(
            "neuronx-cc",
            "problem",
            "absent",
            "pip install 'neuronx-cc==2.*' --extra-index-url https://pip.repos.neuron.amazonaws.com",
        )
    ]
    checks.append(Check("nki", "info", dist_version("nki") or "absent"))
    return checks


#: The 2.33 compiler: a newer one is a later release (2.34's exact version is unconfirmed).
COMPILER_2_33 = (2, 28, 7631)
#: What scripts/install-neuron.sh resolved (release, OS, packages), written into the environment it built.
SDK_RECORD = Path(sys.prefix) / "neuron-sdk.txt"


def sdk_release(cc: str | None) -> str:
    """Which Neuron release a neuronx-cc version belongs to, as far as this project knows."""
    try:
        found = tuple(int(x) for x in (cc or "").split(".")[:3])
    except ValueError:
        return "unknown"
    if not found:
        return "unknown"
    if found == COMPILER_2_33:
        return "2.33"
    return "newer than 2.33 (2.34 or later)" if found > COMPILER_2_33 else "older than 2.33 (not TorchNeuron's)"


#: The Neuron release of each TorchNeuron build: its third and fourth numbers (2.13.3.0 / 2.14.3.0 were Neuron
#: 2.33; 2.13.3.1 / 2.14.3.1 are 2.34, AWS's torch-neuronx v2.34.0 release notes).
TORCHNEURON_RELEASES = {(3, 0): "2.33", (3, 1): "2.34"}


def torchneuron_release(found: str | None) -> str | None:
    """Which Neuron release a torch-neuronx version is (None when this project does not know it)."""
    try:
        build = tuple(int(x) for x in (found or "").split("+")[0].split(".")[2:4])
    except ValueError:
        return None
    return TORCHNEURON_RELEASES.get(build) if len(build) == 2 else None


def check_sdk_release(record: Path = SDK_RECORD) -> Check:
    """Info only: the release torch-neuronx (and the compiler) say, and the install script's own record when it
    built this Python."""
    neuronx = dist_version("torch-neuronx")
    release = torchneuron_release(neuronx)
    found = f"compiler from Neuron {sdk_release(dist_version('neuronx-cc'))}"
    if neuronx is not None:
        named = f"Neuron SDK {release}" if release else "a Neuron release this project does not know"
        found = f"{named} (torch-neuronx {neuronx}); {found}"
    try:
        lines = record.read_text(errors="replace").splitlines()
    except OSError:
        return Check("neuron sdk", "info", f"{found}; not installed by scripts/install-neuron.sh")
    return Check("neuron sdk", "info", f"{found}; {lines[0] if lines else 'empty record'} ({record})")
