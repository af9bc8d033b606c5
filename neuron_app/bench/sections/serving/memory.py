"""Bench section `memory`: the peak resident memory of the processes the other sections measured (run after them)."""

from __future__ import annotations

from typing import Any

from neuron_app.bench import markdown as md
from neuron_app.bench.common import BenchError

TITLE = "6. Memory"


def section(harness: Any) -> dict[str, Any]:
    mode = harness.cfg.serving_mode
    rows = []
    for name, run in harness.results.get("modes", {}).get("runs", {}).items():
        rows.append({"process": f"worker, {name}", "mode": name, "peak_rss_mb": run["peak_rss_mb"]})
    serve = harness.results.get("serving", {}).get("server", {})
    if "peak_rss_mb" in serve:
        rows.append({"process": "app server (after serving)", "mode": mode, "peak_rss_mb": serve["peak_rss_mb"]})
    for row in harness.results.get("startup", {}).get("rows", []):
        process = f"python app.py ({row['start']}, sampled)"
        rows.append({"process": process, "mode": mode, "peak_rss_mb": row["peak_rss_mb"]})
    if not rows:
        raise BenchError("no process was measured: run the modes, serving or startup sections with memory")
    return {"rows": rows}


def render(sec: dict[str, Any]) -> str:
    return md.columns(
        [("process", "process"), ("mode", "mode"), ("peak RSS MB", "peak_rss_mb", lambda v: md.num(v, 0))], sec["rows"]
    )
