"""Which memory is on the emulated device, by storage, and the HBM it takes: one logical core's allocator.

A real device tensor is device memory, whatever Python objects point at it: a view, `.data`, a new
`nn.Parameter` over it, a DTensor's local shard all share one storage. So placement follows the untyped
storage, not the Python object (the fourth review's T5: an identity map missed `Module.to("cpu")`, which
swaps `param.data`, and put weak references on tensors, which `torch.utils.swap_tensors` refuses). A
storage not on the device is host memory (T4: a tensor made on the host without `device=` is on the host).

Each storage is on one device index (`neuron:N`, the N-th core this process holds: `numbering.py`), counted
on that core's account; the capacity is per HBM bank (one core's own at LNC=2, two neighbouring cores' shared
one at LNC=1). The storages on the device are HBM in use: weights and live activations alike, counted when they are
placed and freed when their storage dies (a finalizer on the storage; torch keeps a storage's Python object
as long as the storage lives), whichever thread made them. A placement past the capacity fails as the
Neuron runtime's allocator does ("Failed to allocate N bytes on DEVICE"), with the bytes asked, in use and
the capacity. The peak is kept for the status and the real-size bench.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from neuron_app.backends.emulator.device import local_part
from neuron_app.backends.emulator.numbering import STATE


@dataclass
class _Entry:
    nbytes: int
    weight: bool
    index: int = 0
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
    """The storages on the device, by device index: the bytes each index holds now and at most, and the capacity
    of one HBM bank (`bank_of`: which indices share one; default the process's `numbering.STATE`)."""

    def __init__(self, capacity: int, bank_of: Callable[[int], int] | None = None) -> None:
        self.capacity = capacity
        self.bank_of = bank_of or STATE.bank
        self._entries: dict[int, _Entry] = {}  # the storage's StorageImpl address -> its entry, while it lives
        self._lock = threading.RLock()  # a finalizer may run inside (a collection during an update)
        self._in_use: dict[int, int] = {}
        self._peak: dict[int, int] = {}
        self.in_use = 0  # every index together (one core's figure in a one-core process)
        self.peak = 0
        self.weights = 0

    def holds(self, value: Any) -> bool:
        storage = storage_of(value)
        return storage is not None and storage._cdata in self._entries

    def index_of(self, value: Any) -> int | None:
        """The device index a tensor's storage is on; None on the host."""
        storage = storage_of(value)
        entry = self._entries.get(storage._cdata) if storage is not None else None
        return entry.index if entry is not None else None

    def is_host(self, value: Any) -> bool:
        """Host memory: a tensor with a host storage that is not on the device."""
        storage = storage_of(value)
        return storage is not None and storage._cdata not in self._entries

    def in_use_of(self, index: int) -> int:
        return self._in_use.get(index, 0)

    def peak_of(self, index: int) -> int:
        return self._peak.get(index, 0)

    def bank_in_use(self, index: int) -> int:
        """What the bank of `index` holds: every index of this process that allocates from it."""
        bank = self.bank_of(index)
        return sum(n for i, n in self._in_use.items() if self.bank_of(i) == bank)

    def claim(self, value: Any, weight: bool = False, force: bool = False, index: int = 0) -> tuple[int, int] | None:
        """Put a tensor's storage on device `index` (left where it is when it is on the device already). Returns
        None when it is there, else (bytes asked, bytes the bank holds) of an allocation past the bank's capacity,
        which is then not placed unless `force` (the `record` mode: counted, and placed anyway)."""
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
            held = self.bank_in_use(index)
            over = (nbytes, held) if held + nbytes > self.capacity else None
            if over is not None and not force:
                return over
            entry = _Entry(nbytes, weight, index)
            self._entries[key] = entry
            self._add(index, nbytes)
            self.weights += nbytes if weight else 0
        weakref.finalize(storage, self._freed, key, entry)
        return over

    def move(self, value: Any, index: int, weight: bool = False, force: bool = False) -> tuple[int, int] | None:
        """A storage on another device index moves to `index` (the emulator's `.to("neuron:N")` of a weight)."""
        current = self.index_of(value)
        if current is not None and current != index:
            self.release(value)
        return self.claim(value, weight, force, index)

    def release(self, value: Any) -> None:
        """Take a tensor's storage off the device (it is host memory from now on)."""
        storage = storage_of(value)
        if storage is not None:
            with self._lock:
                entry = self._entries.get(storage._cdata)
                if entry is not None:
                    self._drop(storage._cdata, entry)

    def _add(self, index: int, nbytes: int) -> None:
        self._in_use[index] = self._in_use.get(index, 0) + nbytes
        self._peak[index] = max(self._peak.get(index, 0), self._in_use[index])
        self.in_use += nbytes
        self.peak = max(self.peak, self.in_use)

    def _freed(self, key: int, entry: _Entry) -> None:
        with self._lock:
            if entry.live and self._entries.get(key) is entry:
                self._drop(key, entry)

    def _drop(self, key: int, entry: _Entry) -> None:
        entry.live = False
        del self._entries[key]
        self._in_use[entry.index] -= entry.nbytes
        self.in_use -= entry.nbytes
        self.weights -= entry.nbytes if entry.weight else 0

    def reset_peak(self, index: int | None = None) -> int:
        """Start a new high-water mark at what is in use now (one index, or all); returns the old peak."""
        with self._lock:
            if index is not None:
                old = self._peak.get(index, 0)
                self._peak[index] = self._in_use.get(index, 0)
                return old
            old, self.peak = self.peak, self.in_use
            self._peak = dict(self._in_use)
            return old

    def storages(self) -> int:
        with self._lock:
            return len(self._entries)


class OnDevice:
    """What the emulator answers about placement, read from its `DeviceMemory` (`self.memory`)."""

    memory: DeviceMemory

    def is_device(self, t: Any) -> bool:
        """On the device: its storage is (a view, `.data` or a new Parameter over it too; a DTensor by its local
        shard: tensor parallel, each rank its shard)."""
        return self.memory.holds(t)

    def index_of(self, t: Any) -> int | None:
        """The device index (`neuron:N`) a tensor's storage is on; None on the host."""
        return self.memory.index_of(t)

    def is_host(self, t: Any) -> bool:
        """On the host: a tensor whose storage is not on the device, however it was made."""
        return self.memory.is_host(t)

    @property
    def weight_bytes(self) -> int:
        return self.memory.weights

    def hbm_bytes_in_use(self) -> int:
        """Device memory held now (weights and live activations, by storage, from every thread)."""
        return self.memory.in_use

    def hbm_peak_bytes(self) -> int:
        """The most device memory held at once since the start (or the last `reset_hbm_peak`)."""
        return self.memory.peak

    def reset_hbm_peak(self) -> int:
        return self.memory.reset_peak()

    def devices(self) -> list[dict[str, Any]]:
        """Per device index this process has (`neuron:N`): its NeuronCore and the HBM it holds now and at most."""
        gib = 2**30
        return [
            {
                "index": i,
                "core": STATE.core(i),
                "in_use_gib": round(self.memory.in_use_of(i) / gib, 3),
                "peak_gib": round(self.memory.peak_of(i) / gib, 3),
            }
            for i in STATE.valid()
        ]
