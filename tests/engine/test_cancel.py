"""Cancel at the next step, in the manager (cpu and neuron-emulated): a caller's `Cancelled` from its progress
callback ends the pipeline call at that step's end; the next request is served with no compile and the same image
as if nothing had happened."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from neuron_app.engine.manager import PipelineManager
from neuron_app.engine.records import ProgressEvent, RequestFailed
from neuron_app.errors import Cancelled


class StopAfter:
    """A caller that asks to stop during step `at` (as a DELETE arriving then): its next step event raises."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.asked = False
        self.steps: list[int] = []

    def __call__(self, event: ProgressEvent) -> None:
        if event.phase != "denoising":
            return
        if self.asked:
            raise Cancelled("stop")
        self.steps.append(event.step)
        self.asked = event.step >= self.at


@pytest.mark.parametrize("device", ["cpu", "neuron-emulated"])
def test_cancel_at_step_2_of_8_stops_at_the_next_step_and_the_next_request_needs_no_compile(
    make_settings: Any, device: str
) -> None:
    manager = PipelineManager(make_settings(device=device, resolutions=["64x64"]))
    failures: list[RequestFailed] = []
    manager.subscribe(lambda event: failures.append(event) if isinstance(event, RequestFailed) else None)
    reference = manager.generate("a red kite", "64x64", 8, 5)  # compiles the shape
    compiles = manager.status().compiles
    stop = StopAfter(2)
    with pytest.raises(Cancelled, match=r"^cancelled at step 3 of 8$"):
        manager.generate("a red kite", "64x64", 8, 5, progress=stop)
    assert stop.steps == [1, 2]  # one more step ran after the ask, then the call ended: no decode, no image
    assert failures[-1].result == "cancelled"
    assert manager.in_flight == 0 and not manager._device_lock.locked()  # the device is free
    again = manager.generate("a red kite", "64x64", 8, 5)
    assert manager.status().compiles == compiles and again.cache == "memory" and not again.compiled
    assert again.usage().compile_s == 0
    assert np.array_equal(np.asarray(again.image), np.asarray(reference.image))  # no state left behind
