"""The neuron device emulated on CPU: the device slot, its rules, modes, cache and `emulate`."""
