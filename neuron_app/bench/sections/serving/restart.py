"""Bench section `restart`: cold (an empty cache folder) vs warm (the same folder, a new process), time to the
first image. The cold run is the modes section's run of the serving mode when there is one."""

from __future__ import annotations

from typing import Any

from neuron_app.bench import markdown as md
from neuron_app.bench.common import ratio

TITLE = "2. Cold vs warm restart"


def section(harness: Any) -> dict[str, Any]:
    mode = harness.cfg.serving_mode
    modes = harness.results.get("modes", {})
    if modes.get("status") == "ok" and mode in modes["runs"]:
        cold, cold_dir, source = modes["runs"][mode], harness.work / f"mode-{mode}" / "cache", f"modes-{mode}"
    else:
        cold_dir = harness.new_cache("restart")
        cold, source = harness.measure_mode(mode, cold_dir, "restart-cold"), "restart-cold"
    warm = harness.measure_mode(mode, cold_dir, "restart-warm")
    rows = []
    for shape in harness.cfg.shapes:
        c, w = cold["shapes"][shape], warm["shapes"][shape]
        row = {"shape": shape, "cold_first_image_s": c["first_image_s"], "warm_first_image_s": w["first_image_s"]}
        row["warm_over_cold"] = ratio(w["first_image_s"], c["first_image_s"])
        row |= {"cold_cache": c["cache"], "warm_cache": w["cache"]}
        rows.append(row | {"cold_compile_s": c["compile_s"], "warm_compile_s": w["compile_s"]})
    return {"mode": mode, "cold_run": source, "cold": _process_times(cold), "warm": _process_times(warm), "rows": rows}


def _process_times(run: dict[str, Any]) -> dict[str, Any]:
    keys = ("load_s", "loaded_at_s", "first_image_at_s", "process_s", "peak_rss_mb")
    return {k: run.get(k) for k in keys}


def render(sec: dict[str, Any]) -> str:
    rows = [
        [
            r["shape"],
            f"{md.s(r['cold_first_image_s'])} ({r['cold_cache']})",
            f"{md.s(r['warm_first_image_s'])} ({r['warm_cache']})",
            md.x(r["warm_over_cold"]),
        ]
        for r in sec["rows"]
    ]
    cold, warm = sec["cold"]["first_image_at_s"], sec["warm"]["first_image_at_s"]
    rows.append(["process start to first image", md.s(cold), md.s(warm), md.x(ratio(warm, cold))])
    return (
        f"Mode {sec['mode']}; cold run: `{sec['cold_run']}` (empty cache folder); warm run: a new process on the "
        "same folder. First image = compile + first generation, seconds (the manager's cache result).\n\n"
        + md.table(["shape", "cold s (cache)", "warm s (cache)", "warm/cold"], rows)
    )
