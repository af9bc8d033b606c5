"""T3 (fourth review): TorchNeuron's compile-cache counters move on its compile queue's worker, not when the Python
call returns. The meter that tells a graph's misses from eager ones synchronizes before and after a new graph's
first run; the emulator's counters land on a worker thread, so a reader that does not synchronize is wrong here too.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from neuron_app.backends.neuron import NeuronBackend


class AsyncDevice(NeuronBackend):
    """The real backend over a device whose counters move only when its queue is drained (`synchronize`), the
    latest a real device may make them move: a queued miss is invisible until then."""

    def __init__(self) -> None:
        super().__init__()
        self.landed = [0, 0]  # (persistent hits, persistent misses) as the counters read
        self.queued = [0, 0]

    def cache_counters(self) -> tuple[int, int]:
        return self.landed[0], self.landed[1]

    def synchronize(self) -> None:
        self.landed = [a + b for a, b in zip(self.landed, self.queued, strict=True)]
        self.queued = [0, 0]


def test_a_graphs_misses_are_its_own_when_the_device_compiles_asynchronously() -> None:
    device = AsyncDevice()
    device.queued[1] += 2  # the text encoder's eager ops, queued before the transformer's graph reaches the backend
    finish = device.check_graph(None, [])
    device.queued[1] += 1  # the graph's own compile: submitted, its miss lands later

    def graph() -> str:
        device.queued[1] += 1  # a second NEFF (its first run compiles what the compile only queued)
        return "ran"

    run = finish(graph)
    assert run() == "ran"
    device.queued[1] += 3  # the VAE's eager ops after the graph
    device.synchronize()  # the request's end
    assert device.graph_misses == 2, "the graph's two misses, neither the encoder's before nor the VAE's after"
    assert device.eager_compile_count(graphs_total=1) == 5


def test_the_emulators_counters_land_on_a_worker_thread_when_the_device_is_synchronized(tmp_path: Path) -> None:
    from neuron_app.backends.emulator.cache import ArtifactStore, forget_memory

    forget_memory()
    store = ArtifactStore(tmp_path)
    counted_on: list[str] = []
    count = store.queue._apply
    store.queue._apply = lambda stat: (counted_on.append(threading.current_thread().name), count(stat))[1]
    assert store.record("graph", "a") is True and store.record("eager", "b") is True
    assert store.counters() == (0, 0), "read without synchronizing: the misses have not landed yet"
    store.flush()
    assert store.counters() == (0, 2) and counted_on == ["neuron-emulator-compile-queue"] * 2


def test_on_neuron_emulated_the_meter_matches_what_the_emulator_compiled(make_settings: Any) -> None:
    """The app's figures, read through the meter, equal the emulator's own synchronous tally: every graph's
    misses counted as the graph's, every eager op's as eager (without the meter's synchronize: 0 graph misses)."""
    from neuron_app.engine.manager import PipelineManager

    manager = PipelineManager(make_settings(device="neuron-emulated", resolutions=["64x64"]))
    record = manager.generate("a fox", "64x64", 2, 1)
    em = manager.backend.emulator
    assert em.graph_compiles > 0 and manager.backend.graph_misses == em.graph_compiles
    assert record.eager_compiles == em.eager_compiles > 0
    assert manager.status().eager_compiles == em.eager_compiles
