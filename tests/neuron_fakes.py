"""Helpers for tests that put the FAKE Neuron SDK (tests/fake_neuron_sdk) on the path.

The fake carries package metadata like the real wheel, so the version family decides whether it
passes for TorchNeuron (2.13.3.1, Neuron 2.34) or for the PyTorch/XLA torch-neuronx (2.9.x).
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

FAKE_SDK = Path(__file__).parent / "fake_neuron_sdk"
TORCHNEURON_VERSION = "2.13.3.1"
XLA_VERSION = "2.9.0.2.15.32035"


#: A FAKE wheel that cannot load, as a TorchNeuron wheel built for another glibc or Python fails at import.
BROKEN_IMPORT = 'raise ImportError("FAKE: libnrt.so.1: cannot open shared object file: No such file or directory")'


def fake_sdk_dir(
    root: Path, sdk_version: str = TORCHNEURON_VERSION, *, dynamo_backend: bool = False, on_import: str = ""
) -> Path:
    """A site folder holding the fake package with metadata of `sdk_version`.

    `dynamo_backend` adds an (empty, FAKE) `torch_neuronx.neuron_dynamo_backend` package, as TorchNeuron has
    and the PyTorch/XLA package has not; `on_import` is Python run first when the fake is imported (a
    raise, a sleep), for a wheel that is installed but does not load.
    """
    if sdk_version == TORCHNEURON_VERSION and not dynamo_backend and not on_import:
        return FAKE_SDK
    tag = hashlib.sha256(f"{sdk_version}|{dynamo_backend}|{on_import}".encode()).hexdigest()[:8]
    site = root / f"fake-sdk-{sdk_version}-{tag}"
    if not site.exists():
        shutil.copytree(FAKE_SDK / "torch_neuronx", site / "torch_neuronx")
        info = site / f"torch_neuronx-{sdk_version}.dist-info"
        info.mkdir()
        metadata = (FAKE_SDK / f"torch_neuronx-{TORCHNEURON_VERSION}.dist-info" / "METADATA").read_text()
        (info / "METADATA").write_text(metadata.replace(TORCHNEURON_VERSION, sdk_version))
        if dynamo_backend:
            backend = site / "torch_neuronx" / "neuron_dynamo_backend"
            backend.mkdir()
            (backend / "__init__.py").write_text('"""FAKE: TorchNeuron\'s dynamo backend package, present."""\n')
        if on_import:
            init = site / "torch_neuronx" / "__init__.py"
            init.write_text(f"{on_import}\n{init.read_text()}")
    return site


@contextmanager
def fake_sdk_on_path(monkeypatch: pytest.MonkeyPatch, site: Path) -> Iterator[None]:
    """Put the fake on sys.path for this process; afterwards nothing of it is left in torch or sys.modules."""
    import torch

    had_neuron = hasattr(torch, "neuron")
    before = getattr(torch, "neuron", None)  # the neuron-emulated device's module, when an emulated test ran
    monkeypatch.syspath_prepend(str(site))
    for name in [m for m in sys.modules if m.split(".")[0] == "torch_neuronx"]:
        monkeypatch.delitem(sys.modules, name)
    try:
        yield
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "torch_neuronx"]:
            del sys.modules[name]
        if not had_neuron and hasattr(torch, "neuron"):
            del torch.neuron
        elif had_neuron:
            torch.neuron = before
