"""Two NeuronCores in one process, probed as the app uses them: does a direct core-to-core copy work, and on which
device does a compiled graph run? (the seventh review's V1 and V2, read from a TorchNeuron source older than 2.34).

Run with two cores held, under the app's fallback settings (`environment.FALLBACK_VARS`): on a trn2
`NEURON_RT_VISIBLE_CORES=0-1 python -m neuron_app.backends.core_probe`, elsewhere under
`python -m neuron_app emulate -m neuron_app.backends.core_probe` (then it reports the emulator's rules). The last
line is JSON: `copy` and `graph`, one sentence each. The selftest runs it (`selftest.check_cores`).
"""

from __future__ import annotations

import json
from typing import Any


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"


def probe() -> dict[str, str]:
    import torch

    source = torch.ones(4, dtype=torch.bfloat16, device="neuron:1")
    try:
        landed = source.to("neuron:0")
        copy = f"a direct copy neuron:1 -> neuron:0 works (landed on {landed.device}); the app goes through the host"
    except Exception as exc:
        copy = f"a direct copy neuron:1 -> neuron:0 is refused ({_first_line(exc)}); the app goes through the host"
    layer = torch.nn.Linear(4, 4).to("neuron:1")
    graph_fn: Any = torch.compile(layer, backend="neuron", fullgraph=True, dynamic=False)
    inputs = torch.ones(1, 4).to("neuron:1")
    torch.neuron.set_device(1)
    graph_fn(inputs)  # compiled and run once on its own core
    torch.neuron.set_device(0)  # its weights and inputs on neuron:1, the current device neuron:0
    try:
        out = graph_fn(inputs)
        torch.neuron.synchronize(0)
        torch.neuron.synchronize(1)
        where = "the current device" if out.device.index == 0 else "its inputs' core"
        graph = f"{where}: called with current device neuron:0 and inputs on neuron:1, its output is on {out.device}"
    except Exception as exc:
        graph = (
            f"the current device: called with current device neuron:0 and inputs on neuron:1 it is refused "
            f"({_first_line(exc)}); the app makes each stage's core current"
        )
    return {"copy": copy, "graph": graph}


if __name__ == "__main__":
    print(json.dumps(probe()), flush=True)
