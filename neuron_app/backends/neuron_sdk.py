"""Which torch-neuronx is installed, told without importing it: TorchNeuron, the PyTorch/XLA package, or none.

Two products share the name `torch-neuronx`: up to Neuron 2.31 it was the PyTorch/XLA package
(2.9.x, device `xla`, no `backend="neuron"`); from Neuron 2.33 the 2.13.* / 2.14.* releases
(2.33: 2.13.3.0.* / 2.14.3.0.*; 2.34, the default install: newer builds of the same families) are
TorchNeuron, the native backend this app uses. `import torch_neuronx` succeeds with both, so the
version family is checked first (torch-free, from package metadata), by the neuron backend and by doctor.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Literal

from neuron_app.environment import dist_version
from neuron_app.errors import DeviceUnavailable

SDK_MODULE = "torch_neuronx"
SDK_DIST = "torch-neuronx"
#: The first torch-neuronx release family that is TorchNeuron (torch 2.13); the XLA package stopped at 2.9.
TORCHNEURON_FROM = (2, 13)
INSTALL_HINT = (
    "device 'neuron' needs TorchNeuron (Neuron SDK 2.34, or 2.33; Trn2/Trn3): torch-neuronx==2.13.* with "
    "torch==2.13.0, or torch-neuronx==2.14.* with torch==2.14.0 (the DLAMI's "
    "/opt/aws_neuronx_venv_torch_neuronx_2_14_0 carries 2.14: install only requirements-common.txt there). It is "
    "not on PyPI: scripts/install-neuron.sh, or pip install -r requirements-neuron.txt (wheels for Ubuntu 26.04, "
    "and 24.04 from 2.34; Python 3.12-3.14; https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/setup/"
    "pytorch/index.html); or choose another device with NEURON_APP_DEVICE=cpu"
)
XLA_FIX = (
    "torch-neuronx {found} is the PyTorch/XLA package (device 'xla', no torch.compile backend 'neuron'), "
    "not TorchNeuron: install torch-neuronx==2.13.* with torch==2.13.0 (or torch-neuronx==2.14.* with "
    "torch==2.14.0) from Neuron SDK 2.34 or 2.33 (see docs/deploy-trn.md), or choose another device with "
    "NEURON_APP_DEVICE=cpu"
)

SdkKind = Literal["torchneuron", "xla", "absent"]


def installed_version() -> str | None:
    """The installed TorchNeuron's version; None for none, and for the emulator's stand-in (`+emulated`, offered to
    diffusers under `python -m neuron_app emulate`): it is no SDK for the neuron backend to serve with."""
    found = dist_version(SDK_DIST)
    return None if found is not None and found.endswith("+emulated") else found


def release_family(found: str) -> tuple[int, int] | None:
    """(major, minor) of a torch-neuronx version, None when it is not a release number."""
    parts = found.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def _has_dynamo_backend() -> bool:
    """TorchNeuron's `torch_neuronx.neuron_dynamo_backend` is on disk (found without importing torch_neuronx),
    or torch already carries TorchNeuron's `neuron` device module: the XLA package has neither."""
    spec = importlib.util.find_spec(SDK_MODULE)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(folder) / "neuron_dynamo_backend").is_dir() or (Path(folder) / "neuron_dynamo_backend.py").is_file():
            return True
    torch = sys.modules.get("torch")  # not imported for this: check_sdk runs before the app's environment is set
    module = getattr(torch, "neuron", None) if torch is not None else None
    return module is not None and not getattr(module, "emulated", False)  # neuron-emulated's stand-in is not one


def sdk_kind(found: str | None) -> SdkKind:
    """Which product a torch-neuronx version is: TorchNeuron (2.13+) or the PyTorch/XLA package (older).

    A version below 2.13 is the XLA package only when TorchNeuron's dynamo backend is absent too: a
    TorchNeuron source build (AWS's route on Ubuntu 22.04/24.04) may say 0.1.0, its source tree's version.
    """
    if found is None:
        return "absent"
    family = release_family(found)
    if family is not None and family >= TORCHNEURON_FROM:
        return "torchneuron"
    return "torchneuron" if _has_dynamo_backend() else "xla"


def check_sdk() -> str:
    """The TorchNeuron version, or `DeviceUnavailable` naming the fix (torch-free: package metadata only)."""
    found = installed_version()
    if found is None:
        if importlib.util.find_spec(SDK_MODULE) is not None:
            raise DeviceUnavailable(
                f"{SDK_MODULE} is importable but has no package metadata: reinstall it; {INSTALL_HINT}"
            )
        raise DeviceUnavailable(f"{SDK_MODULE} is not installed: {INSTALL_HINT}")
    if sdk_kind(found) == "xla":
        raise DeviceUnavailable(XLA_FIX.format(found=found))
    return found
