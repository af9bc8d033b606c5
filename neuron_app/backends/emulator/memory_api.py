"""`torch.accelerator`'s device and memory functions on the emulated device, as Neuron 2.34 has them.

The torch-neuronx 2.34 release notes: "The torch.accelerator memory functions ... work on Neuron". torch's own
`torch.accelerator.memory_allocated()` etc. ask its C++ device allocator (`torch._C._accelerator_getDeviceStats`),
which the emulated device (torch's Python stand-ins for PrivateUse1) does not have: "device_allocator INTERNAL
ASSERT FAILED" (the review's U8). Under `python -m neuron_app emulate` those entry points answer from
`torch.neuron` (`device.py`: the emulator's account per device index) while the accelerator is `neuron`, so
diffusers' `backend_max_memory_allocated("neuron")` / `TorchDeviceBackend("neuron").max_memory_allocated()` run.
"""

from __future__ import annotations

from typing import Any

#: torch._C entry point -> how the emulated device answers it (`module` is `torch.neuron`, the emulator's).
_ANSWERS: dict[str, Any] = {
    "_accelerator_isAllocatorInitialized": lambda module: True,
    "_accelerator_getDeviceStats": lambda module, index=None: _stats(module, index),
    "_accelerator_resetPeakStats": lambda module, index=None: module.reset_peak_memory_stats(index),
    "_accelerator_resetAccumulatedStats": lambda module, index=None: module.reset_accumulated_memory_stats(index),
    "_accelerator_emptyCache": lambda module: module.empty_cache(),
    "_accelerator_getMemoryInfo": lambda module, index=None: _memory_info(module, index),
    "_accelerator_getDeviceIndex": lambda module: module.current_device(),
    "_accelerator_setDeviceIndex": lambda module, index: module.set_device(index),
    "_accelerator_synchronizeDevice": lambda module, index=None: module.synchronize(index),
}


def _stats(module: Any, index: Any) -> dict[str, Any]:
    """The nested form torch.accelerator.memory_stats flattens (`allocated_bytes.all.current`, ...)."""
    now, peak = module.memory_allocated(index), module.max_memory_allocated(index)
    counts = {"current": now, "peak": peak, "allocated": now, "freed": 0}
    return {"allocated_bytes": {"all": counts}, "reserved_bytes": {"all": dict(counts)}}


def _memory_info(module: Any, index: Any) -> tuple[int, int]:
    """(free, total) of the device's HBM bank, as torch.accelerator.get_memory_info gives them."""
    total = module.get_device_properties(index).total_memory
    return max(total - module.memory_allocated(index), 0), total


def install(module: Any) -> None:
    """Answer torch.accelerator's device and memory calls from the emulated `torch.neuron` while the current
    accelerator is the emulated device; anything else still goes to torch's own."""
    import torch

    for name, answer in _ANSWERS.items():
        original = getattr(torch._C, name, None)
        if original is None or getattr(original, "neuron_emulated", False):
            continue

        def entry(*args: Any, _original: Any = original, _answer: Any = answer) -> Any:
            accelerator = torch._C._accelerator_getAccelerator()
            if accelerator.type != "neuron" or not module.is_available():
                return _original(*args)
            return _answer(module, *args)

        entry.neuron_emulated = True  # type: ignore[attr-defined]
        setattr(torch._C, name, entry)
