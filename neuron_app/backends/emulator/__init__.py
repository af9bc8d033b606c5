"""The neuron device emulated on CPU: the device slot, its rules, modes, cache and `emulate`.

`RULES` names every rule the emulator enforces (a failure of the request, as the device fails it) and where it is
enforced (`module:attribute`); docs/neuron-emulator.md's rule table has one row per name, and
tests/backends/test_emulator_rules.py reads the two against each other. Torch-free: names only.
"""

from __future__ import annotations

_E = "neuron_app.backends.emulator"

#: rule name -> where the emulator enforces it.
RULES: dict[str, str] = {
    "strided-write": f"{_E}.rules:NeuronEmulator.check_op",
    "random-on-device": f"{_E}.modes:_PlacementMode.__torch_function__",
    "dynamic-shapes": f"{_E}.rules:NeuronEmulator.check_graph",
    "float64-graph": f"{_E}.rules:NeuronEmulator.check_graph",
    "mixed-devices": f"{_E}.rules:NeuronEmulator.check_op",
    "numpy-of-device": f"{_E}.modes:_PlacementMode.__torch_function__",
    "host-into-graph": f"{_E}.rules:NeuronEmulator.graph",
    "hbm-capacity": f"{_E}.rules:NeuronEmulator.place",
    "latched-error": f"{_E}.rules:NeuronEmulator.raise_latched",
    "forked-child": f"{_E}.lifecycle:use",
    "core-reservation": f"{_E}.cores:acquire",
    "device-index": f"{_E}.numbering:DeviceState.check",
    "cores-taken": f"{_E}.emulate:take_cores",
    "memory-functions": f"{_E}.device:_DeviceModule.memory_allocated",
    "lnc-shared-bank": f"{_E}.placement:DeviceMemory.bank_in_use",
    "cross-core-copy": f"{_E}.rules:NeuronEmulator.refuse_cross_core",
    "current-device": f"{_E}.rules:NeuronEmulator.graph",
    "set-device-index": f"{_E}.numbering:DeviceState.checked_by_python",
    "runtime-before-group": f"{_E}.numbering:on_process_group",
    "one-core-per-rank": f"{_E}.cores:acquire",
    "rank-core-at-group": f"{_E}.numbering:on_process_group",
}
