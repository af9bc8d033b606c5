"""FAKE torch_neuronx for tests: the real Neuron SDK cannot be installed on these machines.

It only records what the real SDK would read at import time.
"""

import os

NEFF_CACHE_AT_IMPORT = os.environ.get("TORCH_NEURONX_NEFF_CACHE_DIR")
