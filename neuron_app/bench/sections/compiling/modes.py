"""Bench section `modes`: eager vs full vs regional compile, each mode in its own process and an empty cache folder.
Per shape: the cold compile (`compile_shape`), the first image, then the steady latency of N calls."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from neuron_app.bench import markdown as md
from neuron_app.bench.common import facts, ratio, since_process_start, summarize, timed_generate, worker_manager

KIND = "measure"
TITLE = "1. Eager vs full vs regional compile"


def section(harness: Any) -> dict[str, Any]:
    def one(mode: str) -> dict[str, Any]:
        return harness.measure_mode(mode, harness.new_cache(f"mode-{mode}"), f"modes-{mode}")

    with ThreadPoolExecutor(max_workers=harness.cfg.jobs) as pool:
        runs = dict(zip(harness.cfg.modes, pool.map(one, harness.cfg.modes), strict=True))
    ratios: dict[str, Any] = {}
    if "full" in runs and "regional" in runs:
        for shape in harness.cfg.shapes:
            full, regional = runs["full"]["shapes"][shape], runs["regional"]["shapes"][shape]
            ratios[shape] = {
                "compile_regional_over_full": ratio(regional["compile_s"], full["compile_s"]),
                "latency_regional_over_full": ratio(regional["steady"]["median_s"], full["steady"]["median_s"]),
            }
    return {"runs": runs, "ratios": ratios}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    steps, repeats = spec["steps"], spec["repeats"]
    manager = worker_manager(spec)
    loaded_at = since_process_start()
    shapes: dict[str, Any] = {}
    first_image_at: float | None = None
    for shape in spec["shapes"]:
        outcome = manager.compile_shape(shape)
        first_s, first = timed_generate(manager, shape, steps, 0)
        if first_image_at is None:
            first_image_at = since_process_start()
        graphs_before = manager.counter.graphs
        latencies = [timed_generate(manager, shape, steps, seed)[0] for seed in range(1, repeats + 1)]
        row = {"compile_s": outcome.compile_s, "graphs": outcome.graphs, "compiled": outcome.compiled}
        row |= {"cache": str(outcome.cache), "first_generate_s": first_s, "first_image_s": outcome.compile_s + first_s}
        row |= {"first_generate_graphs": first.graphs_compiled, "steady": summarize(latencies)}
        shapes[shape] = row | {"steady_graphs": manager.counter.graphs - graphs_before}  # 0: no recompile on seed
    return facts(manager) | {
        "load_s": manager.status().load_s,
        "loaded_at_s": loaded_at,
        "first_image_at_s": first_image_at,
        "graphs_total": manager.counter.graphs,
        "compile_failures": manager.counter.failures,
        "shapes": shapes,
    }


def render(sec: dict[str, Any]) -> str:
    rows = [
        s | {"shape": shape, "mode": mode, "backend": run["backend"] if mode != "eager" else "-"}
        for mode, run in sec["runs"].items()
        for shape, s in run["shapes"].items()
    ]
    text = (
        "Each mode in its own process with an empty cache folder. Cold compile = `compile_shape` (a one-step "
        "warm-up at that shape); the first shape of a process also pays the compiler's one-time start-up. "
        "Latency = `generate()` wall time after the first image.\n\n"
    )
    columns = [
        ("shape", "shape"),
        ("mode", "mode"),
        ("backend", "backend"),
        ("graphs", "graphs"),
        ("cold compile s", "compile_s", md.s),
        ("first image s", "first_image_s", md.s),
        ("latency median ms", "steady.median_s", md.ms),
        ("latency p95 ms", "steady.p95_s", md.ms),
        ("n", "steady.n"),
        ("recompiles after", "steady_graphs"),
    ]
    text += md.columns(columns, rows)
    if sec["ratios"]:
        ratio_rows = [r | {"shape": shape} for shape, r in sec["ratios"].items()]
        columns = [
            ("shape", "shape"),
            ("compile regional/full", "compile_regional_over_full", md.x),
            ("latency regional/full", "latency_regional_over_full", md.x),
        ]
        text += "\n\n" + md.columns(columns, ratio_rows)
    return text
