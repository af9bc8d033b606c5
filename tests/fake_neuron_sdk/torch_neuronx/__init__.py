"""FAKE torch_neuronx for tests: the real Neuron SDK cannot be installed on these machines.

It records what the real SDK reads at import time (the NEFF cache folder, the fallback switches),
exposes the private compile-cache counters TorchNeuron has (`_C._get_compilation_cache_stats`),
and gives torch a `neuron` device module with FAKE_NEURON_CORES cores (default 2; 0 = no device).
It runs nothing: no test may generate an image on it.
"""

import os
import types

import torch

from torch_neuronx import _C  # noqa: F401  (the counters, like the real extension module)

NEFF_CACHE_AT_IMPORT = os.environ.get("TORCH_NEURONX_NEFF_CACHE_DIR")
FALLBACK_AT_IMPORT = {
    name: os.environ.get(name)
    for name in ("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS")
}
SYNC_CALLS = [0]


def _synchronize(device=None):
    SYNC_CALLS[0] += 1


_cores = int(os.environ.get("FAKE_NEURON_CORES", "2"))
device = types.SimpleNamespace(
    is_available=lambda: _cores > 0,
    device_count=lambda: _cores,
    current_device=lambda: 0,
    synchronize=_synchronize,
)
torch.neuron = device  # tests.neuron_fakes.fake_sdk_on_path puts back whatever was there before
