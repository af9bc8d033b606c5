"""Compile time you can see coming: the estimate from the manifest's history, and how the page words it.

Also the status merge across replicas (pure data; the Ray path itself is tests/test_replicas.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from neuron_app.engine.cache import ManifestEntry, estimate_compile_s
from neuron_app.engine.records import ShapeState


def _entry(resolution: str, compile_s: float, fingerprint: str = "fp") -> ManifestEntry:
    return ManifestEntry(resolution, fingerprint, {}, compile_s, 1, "miss")


def test_no_history_gives_no_number() -> None:
    assert estimate_compile_s({}, "1024x1024", "fp") is None


def test_the_shapes_own_entry_wins() -> None:
    entries = {"1024x1024": _entry("1024x1024", 120.0), "512x512": _entry("512x512", 40.0)}
    assert estimate_compile_s(entries, "1024x1024", "fp") == 120.0


def test_other_shapes_are_scaled_by_image_tokens_within_limits() -> None:
    entries = {"1024x1024": _entry("1024x1024", 120.0)}  # 4096 tokens
    assert estimate_compile_s(entries, "1024x768", "fp") == 90.0  # 3072 tokens: 0.75x
    assert estimate_compile_s(entries, "2048x2048", "fp") == 240.0  # 4x the tokens, clamped to 2x
    assert estimate_compile_s(entries, "256x256", "fp") == 60.0  # 1/16 the tokens, clamped to 0.5x


def test_other_configurations_give_their_mean() -> None:
    entries = {"1024x1024": _entry("1024x1024", 100.0, "old"), "768x768": _entry("768x768", 50.0, "old")}
    assert estimate_compile_s(entries, "1024x1024", "new") == 75.0


def test_the_estimate_reaches_status_and_the_dropdown_label(module_manager: Any) -> None:
    from neuron_app.web.views import estimate_text, shape_label, shapes_table

    status = module_manager.status()
    cold = next(s for s in status.shapes.values() if s.state is ShapeState.NOT_COMPILED)
    if not module_manager.manifest.entries():
        assert cold.estimate_s is None
        assert shape_label(cold).endswith("compiles on first use, no history for an estimate")
    module_manager.compile_shape("64x64")
    status = module_manager.status()
    cold = status.shapes["128x128"]
    expected = status.shapes["64x64"].compile_s * 2  # 4x the tokens of 64x64, clamped to 2x
    assert cold.estimate_s is not None and abs(cold.estimate_s - expected) < 0.01
    assert shape_label(cold) == f"128x128 - compiles on first use, {estimate_text(cold)}"
    assert shape_label(replace(cold, estimate_s=42.0)) == "128x128 - compiles on first use, about 42 s"
    assert shape_label(replace(cold, estimate_s=150.0)) == "128x128 - compiles on first use, about 2 min"
    row = next(r for r in shapes_table(status) if r[0] == "128x128")
    assert row[1].startswith("not_compiled, about")
    # the compile's own progress line carries the same words, from the manager (the page only shows messages)
    events: list[Any] = []
    module_manager.generate("estimate", "128x128", 1, 0, progress=events.append)
    (compiling,) = [e for e in events if e.phase == "compiling"]
    assert f"({estimate_text(cold)})" in compiling.message, compiling.message


def test_replica_statuses_merge_into_the_managers_contract(module_manager: Any) -> None:
    """A shape is ready where one replica has it; counters are summed; each replica gets a row."""
    from neuron_app.scale.replicas import merge_statuses

    module_manager.compile_shape("64x64")
    ready = module_manager.status()
    not_compiled = replace(ready.shapes["128x128"], state=ShapeState.NOT_COMPILED)  # whatever earlier tests did
    ready = replace(ready, shapes={**ready.shapes, "128x128": not_compiled})
    cold = replace(ready, shapes={k: replace(v, state=ShapeState.NOT_COMPILED) for k, v in ready.shapes.items()})
    rows = [
        {"id": "a", "healthy": True, "in_flight": 0, "ready_shapes": ready.ready},
        {"id": "b", "healthy": True, "in_flight": 1, "ready_shapes": []},
    ]
    merged = merge_statuses(module_manager.settings, [ready, cold], rows)
    assert merged.shapes["64x64"].state is ShapeState.READY and merged.shapes["64x64"].ready_replicas == 1
    assert merged.shapes["128x128"].ready_replicas == 0
    assert merged.compiles == ready.compiles + cold.compiles
    data = merged.to_dict()
    assert data["replicas"] == rows and data["shapes"]["64x64"]["state"] == "ready"
