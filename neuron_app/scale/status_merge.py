"""Many replicas' statuses as one `ManagerStatus`: what the page, the API and /metrics read through replicas.

A shape is ready where at least one replica has it ready; counters are summed over replicas.
"""

from __future__ import annotations

from typing import Any

from neuron_app.engine.records import ManagerStatus, ShapeState, ShapeStatus
from neuron_app.settings import Settings


def merge_statuses(settings: Settings, statuses: list[ManagerStatus], replicas: list[dict[str, Any]]) -> ManagerStatus:
    """A shape is ready where at least one replica has it ready; counters are summed over replicas."""
    shapes = {}
    base = statuses[0] if statuses else None
    for name in settings.resolutions:
        per = [s.shapes[name] for s in statuses if name in s.shapes]
        states = [p.state for p in per]
        ready = sum(1 for st in states if st is ShapeState.READY)
        for state in (ShapeState.READY, ShapeState.COMPILING, ShapeState.FAILED, ShapeState.NOT_COMPILED):
            if state in states:
                break
        else:
            state = ShapeState.NOT_COMPILED
        first = next((p for p in per if p.state is state), None)
        shapes[name] = ShapeStatus(
            resolution=name,
            state=state,
            hits=sum(p.hits for p in per),
            compile_s=first.compile_s if first else None,
            graphs=first.graphs if first else 0,
            cache=first.cache if first else None,
            last_error=next((p.last_error for p in per if p.last_error), None),
            manifest=first.manifest if first else "absent",
            shared_with=first.shared_with if first else None,
            offered=(not settings.only_precompiled) or any(p.offered for p in per),
            estimate_s=next((p.estimate_s for p in per if p.estimate_s is not None), None),
            ready_replicas=ready,
            eager_compiles=sum(p.eager_compiles for p in per),
            degraded=any(p.degraded for p in per),
            fallback_ops=sorted({op for p in per for op in p.fallback_ops}),
            nki_attention=first.nki_attention if first else None,
        )
    return ManagerStatus(
        edits=_merged_edits(statuses),
        model=settings.model,
        device=base.device if base else settings.device,
        dtype=base.dtype if base else settings.dtype,
        compile_mode=base.compile_mode if base else settings.compile_mode,  # "auto" as a replica resolved it
        compile_backend=base.compile_backend if base else (settings.compile_backend or "default"),
        tp_degree=settings.tp_degree,
        cache_dir=str(settings.cache_dir),
        cache_size_bytes=max((s.cache_size_bytes for s in statuses), default=0),
        loaded=any(s.loaded for s in statuses),
        loading=not statuses,
        load_s=base.load_s if base else None,
        load_error=next((s.load_error for s in statuses if s.load_error), None),
        compiles=sum(s.compiles for s in statuses),
        compile_failures=sum(s.compile_failures for s in statuses),
        fingerprint=base.fingerprint if base else "",
        warmup=base.warmup if base else {"mode": settings.warmup, "running": False, "done": [], "pending": []},
        shapes=shapes,
        loras=base.loras if base else [],
        fallback=base.fallback if base else "",
        broken=next((s.broken for s in statuses if s.broken), None),
        replicas=replicas,
        vae_compiles=sum(s.vae_compiles for s in statuses),
        prompt_cache=_summed([s.prompt_cache for s in statuses]),
        safety=_merged_safety([s.safety for s in statuses]),
        stages=_merged_stages([s.stages for s in statuses if s.stages]),
        eager_compiles=sum(s.eager_compiles for s in statuses),
        neuron_rules=_merged_rules([s.neuron_rules for s in statuses if s.neuron_rules]),
        plan=next((s.plan for s in statuses if s.plan), None),  # one model, one plan: any replica's line
        placement=base.placement if base else {},
        topology=dict(settings.topology or {}),  # the front process chose it; every replica holds one block
    )


def _merged_edits(statuses: list[ManagerStatus]) -> dict[str, ShapeStatus]:
    """Every replica's edit graphs by label: one that any replica has compiled, is compiling or finds precompiled
    shows as that replica reports it (what the front end's check of an edit reads, engine/modes/edit_graphs.py)."""
    edits: dict[str, ShapeStatus] = {}
    for status in statuses:
        for name, edit in status.edits.items():
            usable = edit.state in (ShapeState.READY, ShapeState.COMPILING) or edit.manifest == "precompiled"
            if name not in edits or usable:
                edits[name] = edit
    return dict(sorted(edits.items()))


def _merged_safety(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The replicas' safety checkers: one setting, counts summed."""
    if not parts or not parts[0]:
        return {}
    counts = _summed([{k: part.get(k, 0) for k in ("passed", "flagged", "graphs")} for part in parts])
    error = next((part["error"] for part in parts if part.get("error")), None)  # one replica's failure shows
    one = {k: parts[0].get(k) for k in ("checker", "model", "device")}
    return one | {"error": error} | counts


def _merged_stages(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Each replica's own device lane and post slots: depths and counts summed, the busiest lane's idle fraction
    left out (a sum of fractions means nothing; each replica's is in its own status)."""
    if not parts:
        return {}
    return {
        stage: _summed([{k: v for k, v in part[stage].items() if isinstance(v, int | float) and k != "idle_fraction"}
                        for part in parts])
        for stage in ("device", "post")
    }  # fmt: skip


def _merged_rules(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """neuron-emulated replicas: one mode, counts summed, the violations of all (the last 20)."""
    if not parts:
        return None
    counts = _summed(
        [{k: part.get(k, 0) for k in ("violation_count", "eager_compiles", "graph_compiles")} for part in parts]
    )
    signatures = max(part.get("eager_signatures", 0) for part in parts)  # one cache folder: the same files
    violations = [v for part in parts for v in part.get("violations", [])][-20:]
    return {"mode": parts[0].get("mode"), "violations": violations, "eager_signatures": signatures} | counts


def _summed(counters: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for counter in counters:
        for key, value in counter.items():
            total[key] = total.get(key, 0) + value
    return total
