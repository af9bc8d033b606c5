"""Bench section `recompile`: a scripted request sequence in one process; each distinct graph shape must compile
exactly once."""

from __future__ import annotations

from typing import Any

from neuron_app.bench import markdown as md
from neuron_app.bench.common import OTHER_PROMPT, PROMPT, facts, timed_generate, worker_manager
from neuron_app.shapes import Resolution

KIND = "sequence"
TITLE = "3. Recompile discipline"


def section(harness: Any) -> dict[str, Any]:
    a, b = harness.cfg.recompile_shapes[0], harness.cfg.recompile_shapes[-1]
    cache_dir, cache_note = harness.cache_for("recompile", fresh=harness.parallel)
    result = harness.run_worker("recompile", harness.spec("sequence", cache_dir, shape_a=a, shape_b=b))
    expected = result["distinct_graph_keys"]
    result["expected_compiles"] = expected
    result["ok"] = result["compile_events"] == expected and result["compile_failures"] == 0
    result["cache_folder"] = cache_note
    return result


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    a, b, steps = spec["shape_a"], spec["shape_b"], spec["steps"]
    calls = [
        ("A", a, steps, 0, PROMPT),
        ("A again", a, steps, 0, PROMPT),
        ("B", b, steps, 0, PROMPT),
        ("A, other steps", a, steps + 1, 0, PROMPT),
        ("A, other seed", a, steps, 1, PROMPT),
        ("B, other prompt", b, steps, 0, OTHER_PROMPT),
    ]
    manager = worker_manager(spec)
    rows = []
    for label, shape, call_steps, seed, prompt in calls:
        before = manager.counter.graphs
        elapsed, record = timed_generate(manager, shape, call_steps, seed, prompt)
        row = {"call": label, "shape": shape, "steps": call_steps, "seed": seed}
        row |= {"prompt": "other" if prompt == OTHER_PROMPT else "same", "compiled": record.compiled}
        row["graphs_compiled"] = record.graphs_compiled
        row["graphs_counted"] = manager.counter.graphs - before  # the backend's own count, any phase
        rows.append(row | {"cache": str(record.cache), "total_s": elapsed})
    keys = {manager.graph_key(Resolution.parse(s)) for s in (a, b)}
    return facts(manager) | {
        "calls": rows,
        "distinct_shapes": len({a, b}),
        "distinct_graph_keys": len(keys),
        "compile_events": sum(1 for r in rows if r["compiled"]),
        "graphs_total": manager.counter.graphs,
        "compile_failures": manager.counter.failures,
    }


COLUMNS = [
    ("#", "n"),
    ("call", "call"),
    ("shape", "shape"),
    ("steps", "steps"),
    ("seed", "seed"),
    ("prompt", "prompt"),
    ("graphs compiled", "graphs_counted"),
    ("cache", "cache"),
]


def render(sec: dict[str, Any]) -> str:
    verdict = "OK" if sec["ok"] else "**WRONG**"
    return (
        md.columns(COLUMNS, [c | {"n": i + 1} for i, c in enumerate(sec["calls"])])
        + f"\n\nMode {sec['mode']} / {sec['backend']}, cache folder {sec['cache_folder']}: "
        f"**{sec['compile_events']} compile(s) for {sec['distinct_graph_keys']} distinct graph shape(s)** "
        f"({sec['graphs_total']} graph(s) in all, {sec['compile_failures']} failure(s)): {verdict}."
    )
