"""The manager's state as data: one `ShapeStatus` per shape and edit graph, one `ManagerStatus` in all.

Read under the manager's state lock, never waiting for the device; web/page/views.py turns it into text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from neuron_app.backends.fallbacks import degrading
from neuron_app.engine.cache.estimates import estimate
from neuron_app.engine.modes.edit_graphs import parse_label
from neuron_app.engine.records import GraphState, ManagerStatus, ShapeState, ShapeStatus
from neuron_app.shapes import GraphKey


def graph_status(
    manager: Any, name: str, key: GraphKey, entries: dict[str, Any], siblings: Sequence[str] = ()
) -> ShapeStatus:
    """One shape's row. A shape whose graph another shape compiles (`siblings`: same `GraphKey`) shows that
    shape's manifest entry and estimate: precompiling 256x128 makes 128x256 precompiled too."""
    graph = manager._graphs.get(key, GraphState())
    fp = manager.fingerprint
    source = name
    if manager.manifest.validity(name, fp, entries) != "precompiled":
        candidates = [s for s in (graph.compiled_as, *siblings) if s]
        source = next((s for s in candidates if manager.manifest.validity(s, fp, entries) == "precompiled"), name)
    validity = manager.manifest.validity(source, fp, entries)
    found = estimate(entries, source, fp, warm=manager.counter.graphs > 0)
    shared = graph.compiled_as if graph.compiled_as not in (None, name) else (None if source == name else source)
    return ShapeStatus(
        resolution=name,
        state=graph.state,
        hits=manager._hits.get(name, 0),
        compile_s=None if graph.compile_s is None else round(graph.compile_s, 3),
        graphs=graph.graphs,
        cache=None if graph.cache is None else str(graph.cache),
        last_error=graph.error,
        manifest=validity,
        shared_with=shared,
        offered=(not manager.settings.only_precompiled) or graph.state is ShapeState.READY or validity == "precompiled",
        estimate_s=None if found is None else round(found.seconds, 3),
        estimate=found,
        eager_compiles=graph.eager_compiles,
        degraded=bool(degrading(graph.fallback_ops)),
        fallback_ops=list(graph.fallback_ops),
        nki_attention=graph.nki_attention,
    )


def build_status(manager: Any) -> ManagerStatus:
    """A snapshot of `manager` for the UI and the API; never waits for the device."""
    entries = manager.manifest.entries()
    with manager._state_lock:
        keys = {str(r): manager.graph_key(r) for r in manager.resolutions}
        shapes = {
            name: graph_status(manager, name, key, entries, [n for n, k in keys.items() if k == key and n != name])
            for name, key in keys.items()
        }
        edits = {n: manager.graph_key(*p) for n in entries if (p := parse_label(n))} | manager._edits
        return ManagerStatus(
            model=manager.settings.model,
            device=manager.backend.name,
            dtype=manager.dtype_name,
            compile_mode=manager.settings.compile_mode,
            compile_backend=manager.compile_backend,
            tp_degree=manager.settings.tp_degree,
            cache_dir=str(manager.settings.cache_dir),
            cache_size_bytes=manager._cache_size.get(),
            loaded=manager._pipe is not None,
            loading=manager._loading,
            load_s=None if manager._load_s is None else round(manager._load_s, 3),
            load_error=manager._load_error,
            compiles=manager.counter.graphs,
            compile_failures=manager.counter.failures,
            vae_compiles=manager.vae_counter.graphs,
            prompt_cache=manager.prompt_cache.snapshot(),
            fingerprint=manager.fingerprint,
            fallback=manager.backend.fallback_state(),
            broken=None if manager.lockstep is None else manager.lockstep.broken,
            warmup=manager.warmup.snapshot(),
            shapes=shapes,
            loras=manager.adapters.describe(),
            remote=manager.remote.snapshot(),
            edits={name: graph_status(manager, name, key, entries) for name, key in sorted(edits.items())},
            eager_compiles=manager.backend.eager_compile_count(manager.counter.graphs),
            neuron_rules=manager.backend.rules_status(),
            safety=manager.safety.snapshot(),
            stages=manager.post.snapshot(manager._device_lock),
            plan=_plan_line(manager).text(),
            placement=manager.placement.view(),
            topology=dict(manager.settings.topology or {}),
        )


def _plan_line(manager: Any) -> Any:
    """The manager's `PlanLine`, made on its first status read (the real model's figures, from fake tensors)."""
    line = manager.__dict__.get("_plan_line")
    if line is None:
        from neuron_app.engine.model.real.served import PlanLine

        settings = manager.settings
        line = manager.__dict__.setdefault(
            "_plan_line", PlanLine(settings.model, list(settings.resolutions), settings.tp_degree, settings.placement)
        )
    return line
