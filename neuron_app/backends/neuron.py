"""AWS Trainium / Inferentia2 through torch-neuronx (the "neuron" device and compile backend).

The SDK is imported only when this backend is chosen. `TORCH_NEURONX_NEFF_CACHE_DIR` must be
set before `import torch`, because torch autoloads torch_neuronx as a device backend.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from pathlib import Path

from neuron_app.backends.base import CacheProbe, DeviceBackend, DeviceUnavailable, FolderCacheProbe

SDK_MODULE = "torch_neuronx"
INSTALL_HINT = (
    "device 'neuron' needs torch-neuronx from the AWS Neuron SDK, which is not on PyPI: use a Neuron "
    "DLAMI or Deep Learning Container, or install it from the Neuron pip repository as the setup guide "
    "says (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/setup/); "
    "or choose another device with NEURON_APP_DEVICE=cpu"
)


class NeuronBackend(DeviceBackend):
    name = "neuron"
    default_dtype = "bfloat16"
    default_compile_backend = "neuron"
    dist_backend = "neuron"
    compiles_eager_ops_per_shape = True  # every op compiles to a NEFF on first use at each shape

    def is_available(self) -> bool:
        return importlib.util.find_spec(SDK_MODULE) is not None

    def require(self) -> None:
        if not self.is_available():
            raise DeviceUnavailable(f"{SDK_MODULE} is not installed: {INSTALL_HINT}")
        try:
            importlib.import_module(SDK_MODULE)
        except Exception as exc:  # a broken SDK install: say so in one line
            raise DeviceUnavailable(f"{SDK_MODULE} failed to import ({exc}): {INSTALL_HINT}") from exc

    def prepare_cache(self, cache_dir: Path) -> None:
        super().prepare_cache(cache_dir)
        folder = cache_dir / "neff"
        folder.mkdir(parents=True, exist_ok=True)
        os.environ["TORCH_NEURONX_NEFF_CACHE_DIR"] = str(folder)

    def compiled_artifacts_dirs(self, cache_dir: Path) -> list[Path]:
        return [cache_dir / "neff", cache_dir / "inductor"]

    def cache_probe(self, compile_backend: str, cache_dir: Path) -> CacheProbe:
        # Eager mode compiles ops into NEFFs too, so the folder is evidence in every mode.
        return FolderCacheProbe(cache_dir / "neff")

    def versions(self) -> dict[str, str]:
        from importlib.metadata import PackageNotFoundError, version

        found = super().versions()
        for dist in ("torch-neuronx", "neuronx-cc", "libneuronxla"):
            with contextlib.suppress(PackageNotFoundError):
                found[dist] = version(dist)
        return found
