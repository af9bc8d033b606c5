"""What runs inside one benchmark subprocess: a fresh interpreter, so dynamo and the caches start clean.

Invoked as `python -m neuron_app.bench _worker '<json spec>'`. The spec names the kind of measurement and the settings
overrides; the answer is one `BENCH_RESULT {json}` line. Everything goes through the project's public API
(`PipelineManager`, `build_app`, `launch`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from neuron_app.bench.common import RESULT_TAG, cpu_seconds, emit, peak_rss_mb, since_process_start
from neuron_app.bench.harness import REGISTRY


def prepare(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the tiny model once, so that no measured process pays for building it."""
    from pathlib import Path

    from neuron_app.engine.model.tiny import ensure_tiny

    folder = ensure_tiny(Path(spec["models_dir"]), spec["variant"])
    return {"folder": str(folder)}


#: Every worker kind: `prepare`, and each section's `measure` under its `KIND`, read from the registry.
KINDS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {"prepare": prepare} | {
    m.KIND: m.measure for m in REGISTRY.values() if hasattr(m, "KIND")
}


def main(argv: list[str]) -> int:
    """Run one measurement; an exception becomes an `error` answer, so the run goes on. Every answer carries the
    process's own times and its peak memory."""
    spec = json.loads(argv[0])
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        result = KINDS[spec["kind"]](spec)
    except Exception as exc:
        logging.exception("worker %s failed", spec.get("kind"))
        emit(RESULT_TAG, {"error": f"{type(exc).__name__}: {str(exc).strip()[:500]}"})
        return 1
    emit(
        RESULT_TAG, result | {"process_s": since_process_start(), "cpu_s": cpu_seconds(), "peak_rss_mb": peak_rss_mb()}
    )
    return 0
