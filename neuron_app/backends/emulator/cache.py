"""The emulator's compile cache, shaped like TorchNeuron's: memory first, then the NEFF folder, with its counters.

TorchNeuron's CompilationCache (as the second review read its source) looks a compile key up in this process's
memory first; only on an in-memory miss does it look on disk, counting `persistent_hits` or
`persistent_misses`. So a second manager in one process, whose graphs dynamo traces again, moves neither
counter; a new process on a warm folder counts hits. The emulator keeps the same two layers (the memory layer
per process and folder, as TorchNeuron's is per process) so that `NeuronCacheProbe` and the eager-compile count
run on its counters instead of being replaced.

TorchNeuron compiles on its own stream: `compile_graph` submits the work and returns, and the counters move when
its worker looks the key up (the fourth review's T3). Here too the counters move on a worker thread, which takes
what is queued when the device is synchronized (`flush`): code that reads them without synchronizing first reads
numbers that are not yet true, as it would on a device.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

#: This process's in-memory layer, per cache folder (what a new process starts without).
_MEMORY: dict[Path, set[str]] = {}
_MEMORY_LOCK = threading.Lock()


def forget_memory() -> None:
    """Drop the in-memory layer: what a restarted process has (tests use it to restart without a new process)."""
    with _MEMORY_LOCK:
        _MEMORY.clear()


class CompileQueue:
    """The counters' side of TorchNeuron's asynchronous compile queue: each lookup's count is made on a worker
    thread, which runs what was queued when the device is synchronized."""

    def __init__(self, apply: Callable[[str], None]) -> None:
        self._apply = apply
        self._pending: list[str] = []
        self._cond = threading.Condition()
        self._asked = self._done = 0  # synchronizations asked for, and served
        self._worker: threading.Thread | None = None

    def submit(self, stat: str) -> None:
        with self._cond:
            self._pending.append(stat)
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="neuron-emulator-compile-queue", daemon=True)
                self._worker.start()

    def flush(self) -> None:
        """Return once every count queued before this call has landed (what `synchronize()` waits for)."""
        with self._cond:
            if self._worker is None:
                return
            self._asked += 1
            wanted = self._asked
            self._cond.notify_all()
            while self._done < wanted:
                self._cond.wait()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._asked == self._done:
                    self._cond.wait()
                wanted, batch, self._pending = self._asked, self._pending, []
            for stat in batch:
                self._apply(stat)
            with self._cond:
                self._done = wanted
                self._cond.notify_all()


class ArtifactStore:
    """NEFF-style files, one per compiled graph or eager-op signature: `<dir>/ab/cd/<32 hex>.neff`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._lock = threading.Lock()
        self.stats = {"in_memory_hits": 0, "persistent_hits": 0, "persistent_misses": 0}
        self._on_disk: int | None = None  # artifacts in the folder, counted once, then kept up to date
        self.queue = CompileQueue(self._count)

    def _count(self, stat: str) -> None:
        with self._lock:
            self.stats[stat] += 1

    def flush(self) -> None:
        """Let the queued counts land (the device's synchronize)."""
        self.queue.flush()

    def _memory(self) -> set[str]:
        with _MEMORY_LOCK:
            return _MEMORY.setdefault(self.folder.resolve(), set())

    def _path(self, key: str) -> Path:
        return self.folder / key[:2] / key[2:4] / f"{key}.neff"

    def record(self, kind: str, signature: str) -> bool:
        """Look `signature` up as TorchNeuron does; True when it compiled (a persistent miss), else False."""
        key = hashlib.sha256(f"{kind}\n{signature}".encode()).hexdigest()[:32]
        memory = self._memory()
        with self._lock:
            if key in memory:
                self.queue.submit("in_memory_hits")
                return False
            memory.add(key)
            path = self._path(key)
            if path.exists():  # an earlier process (or another one, meanwhile) compiled it
                self.queue.submit("persistent_hits")
                return False
            self.queue.submit("persistent_misses")
            if self._on_disk is not None:
                self._on_disk += 1
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp.{os.getpid()}.{threading.get_ident()}.{path.name}")
        tmp.write_text(json.dumps({"kind": kind, "signature": signature, "emulated": True}))
        os.replace(tmp, path)
        return True

    def counters(self) -> tuple[int, int]:
        """(persistent hits, persistent misses), as `torch_neuronx._C._get_compilation_cache_stats()` gives them:
        what has landed so far (`flush` first for the true figures)."""
        with self._lock:
            return self.stats["persistent_hits"], self.stats["persistent_misses"]

    def count(self) -> int:
        """Artifacts in the folder: the ones there at the first count, plus this process's."""
        with self._lock:
            if self._on_disk is None:
                self._on_disk = sum(1 for _ in self.folder.rglob("*.neff")) if self.folder.is_dir() else 0
            return self._on_disk
