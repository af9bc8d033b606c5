"""Benchmark harness: compile cost, cache wins, recompile discipline, serving overhead, measured side by side.

`python -m neuron_app.bench --help`. Every measurement that depends on process state (dynamo's
compiled graphs, the compilers' disk caches, peak memory) runs in its own subprocess
(`python -m neuron_app.bench _worker ...`), so modes never share a warm process. Ratios come
from one run, so a machine that is busy for the whole run still compares like with like.
"""

from __future__ import annotations

from typing import Any

SCHEMA_VERSION = 1


def __getattr__(name: str) -> Any:
    """`SECTIONS`: the registry's section names, in order (read on first use: the harness imports this package)."""
    if name == "SECTIONS":
        from neuron_app.bench.harness import REGISTRY

        return tuple(REGISTRY)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
