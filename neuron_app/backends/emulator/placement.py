"""Which memory is on the emulated device, by storage, and the HBM it takes: one logical core's allocator.

A real device tensor is device memory, whatever Python objects point at it: a view, `.data`, a new
`nn.Parameter` over it, a DTensor's local shard all share one storage. So placement follows the untyped
storage, not the Python object (the fourth review's T5: an identity map missed `Module.to("cpu")`, which
swaps `param.data`, and put weak references on tensors, which `torch.utils.swap_tensors` refuses). A
storage not on the device is host memory (T4: a tensor made on the host without `device=` is on the host).

The storages on the device are HBM in use: weights and live activations alike, counted when they are
placed and freed when their storage dies (a finalizer on the storage; torch keeps a storage's Python object
as long as the storage lives), whichever thread made them. A placement past the capacity fails as the
Neuron runtime's allocator does ("Failed to allocate N bytes on DEVICE"), with the bytes asked, in use and
the capacity. The peak is kept for the status and the real-size bench.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from neuron_app.backends.emulator.device import local_part


@dataclass
class _Entry:
    nbytes: int
    weight: bool
    live: bool = True


def storage_of(value: Any) -> Any:
    """The host storage behind a tensor (a DTensor's: its local shard's), or None: not a tensor, or one with
    no memory here (meta, fake, sparse)."""
    if not isinstance(value, torch.Tensor):
        return None
    value = local_part(value)
    try:
        with torch._C.DisableTorchFunction():
            storage = value.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return storage if storage.device.type == "cpu" else None


class DeviceMemory:
    """The storages on the device, the bytes they hold now and at most, and the capacity of one logical core."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: dict[int, _Entry] = {}  # the storage's StorageImpl address -> its entry, while it lives
        self._lock = threading.RLock()  # a finalizer may run inside (a collection during an update)
        self.in_use = 0
        self.peak = 0
        self.weights = 0

    def holds(self, value: Any) -> bool:
        storage = storage_of(value)
        return storage is not None and storage._cdata in self._entries

    def is_host(self, value: Any) -> bool:
        """Host memory: a tensor with a host storage that is not on the device."""
        storage = storage_of(value)
        return storage is not None and storage._cdata not in self._entries

    def claim(self, value: Any, weight: bool = False, force: bool = False) -> tuple[int, int] | None:
        """Put a tensor's storage on the device. Returns None when it is there (now or already), else
        (bytes asked, bytes in use) of an allocation past the capacity, which is then not placed unless
        `force` (the `record` mode: counted, and placed anyway)."""
        storage = storage_of(value)
        if storage is None:
            return None
        key = storage._cdata
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                if weight and not entry.weight:
                    entry.weight = True
                    self.weights += entry.nbytes
                return None
            nbytes = storage.nbytes()
            if self.in_use + nbytes > self.capacity:
                if not force:
                    return nbytes, self.in_use
                over = (nbytes, self.in_use)
            else:
                over = None
            entry = _Entry(nbytes, weight)
            self._entries[key] = entry
            self.in_use += nbytes
            self.weights += nbytes if weight else 0
            self.peak = max(self.peak, self.in_use)
        weakref.finalize(storage, self._freed, key, entry)
        return over

    def release(self, value: Any) -> None:
        """Take a tensor's storage off the device (it is host memory from now on)."""
        storage = storage_of(value)
        if storage is not None:
            with self._lock:
                entry = self._entries.get(storage._cdata)
                if entry is not None:
                    self._drop(storage._cdata, entry)

    def _freed(self, key: int, entry: _Entry) -> None:
        with self._lock:
            if entry.live and self._entries.get(key) is entry:
                self._drop(key, entry)

    def _drop(self, key: int, entry: _Entry) -> None:
        entry.live = False
        del self._entries[key]
        self.in_use -= entry.nbytes
        self.weights -= entry.nbytes if entry.weight else 0

    def reset_peak(self) -> int:
        """Start a new high-water mark at what is in use now; returns the old peak."""
        with self._lock:
            old, self.peak = self.peak, self.in_use
            return old

    def storages(self) -> int:
        with self._lock:
            return len(self._entries)
