"""The emulator's own `torch_neuronx`, for code that looks for the Neuron SDK before it uses the device.

diffusers decides "Neuron is here" by `is_torch_neuronx_available()` (a `torch_neuronx` module that import
finds, with distribution metadata) and `torch.neuron.is_available()`; its tests gate their Neuron tests on
both (`require_torch_neuron`). Under `python -m neuron_app emulate` this module is that `torch_neuronx`: found
by `importlib`, with metadata that names it the emulator's (`__version__` ends in `+emulated`, `emulated` is
True), and the few calls such code makes (`neuron_dynamo_backend.set_model_name`, `get_fallback_ops`). It is
a stand-in named as one: nothing here is TorchNeuron, and the app's own SDK checks refuse it (`emulated`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types
from typing import Any

#: The TorchNeuron release the emulator plays (Neuron 2.34's torch-neuronx for torch 2.13), marked emulated.
VERSION = "2.13.3.1+emulated"
NAME = "torch_neuronx"
_FILES = {
    "METADATA": f"Metadata-Version: 2.1\nName: torch-neuronx\nVersion: {VERSION}\n"
    "Summary: EMULATED torch-neuronx: neuron_app's CPU emulator of TorchNeuron, not the AWS Neuron SDK\n",
    "top_level.txt": f"{NAME}\n",
}


class _Distribution(importlib.metadata.Distribution):
    """`importlib.metadata.version("torch_neuronx")`: the emulator's metadata, not a wheel's."""

    def read_text(self, filename: str) -> str | None:
        return _FILES.get(filename)

    def locate_file(self, path: Any) -> Any:
        return path


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the emulated package (once installed) and its distribution; nothing else."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        module = sys.modules.get(fullname)
        if fullname.split(".")[0] == NAME and getattr(module, "emulated", False):
            return module.__spec__
        return None

    def find_distributions(self, context: Any = importlib.metadata.DistributionFinder.Context()) -> Any:
        name = (context.name or "").replace("-", "_").lower()
        return iter([_Distribution()]) if context.name is None or name == NAME else iter([])


def _module(name: str, doc: str, package: bool) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=package)
    if package:
        module.__path__ = []  # type: ignore[attr-defined]
    module.emulated = True  # type: ignore[attr-defined]
    return module


def install(em: Any) -> types.ModuleType | None:
    """Put the emulated `torch_neuronx` (and `torch_neuronx.neuron_dynamo_backend`) in `sys.modules`; None where
    the real one is installed (a trn instance): it is never shadowed."""
    if getattr(sys.modules.get(NAME), "emulated", False):
        return sys.modules[NAME]
    if NAME in sys.modules or importlib.util.find_spec(NAME) is not None:
        return None
    package = _module(NAME, "EMULATED torch_neuronx (neuron_app's emulator on CPU, not the AWS Neuron SDK).", True)
    package.__version__ = VERSION  # type: ignore[attr-defined]
    package.get_fallback_ops = em.fallback_invocations  # type: ignore[attr-defined]
    backend = _module(f"{NAME}.neuron_dynamo_backend", "EMULATED: the neuron torch.compile backend's names.", False)
    names: list[str] = []
    backend.set_model_name = names.append  # type: ignore[attr-defined]  # a label for the next graph's NEFFs
    backend.model_names = names  # type: ignore[attr-defined]
    package.neuron_dynamo_backend = backend  # type: ignore[attr-defined]
    sys.modules[NAME] = package
    sys.modules[backend.__name__] = backend
    sys.meta_path.insert(0, _Finder())
    return package
