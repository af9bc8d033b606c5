"""The runtime's life in a process: started once, never again in a forked child (TorchNeuron's fork rule).

TorchNeuron starts the Neuron runtime lazily (`torch_neuronx._lazy_init`) and registers `os.register_at_fork`: a
child forked after the parent started it is marked, and its first device use raises "Cannot re-initialize Neuron
runtime in forked subprocess ..." (TorchNeuron's `torch_neuronx/__init__.py`, `_after_fork` / `_lazy_init`). A
forking DataLoader or worker pool therefore fails on a trn2; a `spawn` child starts a runtime of its own.

The emulator plays the same: the first device use of a process starts the emulated runtime (`use`), and a child
forked after that is refused at its first device use. A child forked before any device use is fine, as on a
device. `spawn` children of `python -m neuron_app emulate` start the emulator first (`emulate.spawn_child`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

#: TorchNeuron's message, word for word (`torch_neuronx/__init__.py`, `_lazy_init`), raised as a RuntimeError.
FORK_MESSAGE = (
    "Cannot re-initialize Neuron runtime in forked subprocess. "
    "To use Neuron with multiprocessing, use the 'spawn' start method"
)

_lock = threading.Lock()
_started_in: int | None = None  # the pid whose device use started the runtime
_bad_fork = False
_registered = False
#: What starting the runtime does that waits for it (a torchrun rank's cores, `emulate.install`): run at the first
#: device use, or by `init_process_group` (`start_deferred`), whichever comes first.
_deferred: list[Callable[[], Any]] = []


def defer(start: Callable[[], Any]) -> None:
    """Run `start` when the runtime starts, not now: a torchrun rank takes its cores at `init_process_group`
    (TorchNeuron sets NEURON_RT_VISIBLE_CORES then) or, touching the device before it, all it sees."""
    _deferred.append(start)


def start_deferred() -> None:
    while _deferred:
        _deferred.pop(0)()


def _after_fork_in_child() -> None:
    """TorchNeuron's `_after_fork`: a child of a process that started the runtime may not start it again."""
    global _started_in, _bad_fork, _lock
    _lock = threading.Lock()  # a lock held by another thread at fork time stays held in the child
    if _started_in is not None and _started_in != os.getpid():
        _started_in = None
        _bad_fork = True


def register() -> None:
    """Install the fork handler once per process (the emulator does it when it starts)."""
    global _registered
    if not _registered:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _registered = True


def use() -> None:
    """A device use: starts the emulated runtime the first time, refused in a child forked after the start."""
    global _started_in
    if _bad_fork:
        raise RuntimeError(FORK_MESSAGE)
    if _started_in is None:
        with _lock:
            if _started_in is None:
                _started_in = os.getpid()
        start_deferred()


def started() -> bool:
    return _started_in is not None and not _bad_fork
