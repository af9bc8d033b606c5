"""Bench section `edit`: compile seconds and latency for 0 to 4 reference images at one output shape, and what
padding every edit to 4 references (one edit graph per shape) would cost each count (docs/compiling-less.md)."""

from __future__ import annotations

from typing import Any

from neuron_app.bench import markdown as md
from neuron_app.bench.common import facts, ratio, summarize, timed_generate, worker_manager
from neuron_app.shapes import Resolution

KIND = "edit"
#: The reference layout a padded edit graph would take: `max_references`' default.
PADDED = 4
TITLE = "11. Editing with reference images"


def section(harness: Any) -> dict[str, Any]:
    shape = harness.cfg.shapes[0]
    others = [s for s in harness.cfg.all_shapes if s != shape]
    warm_shape = others[0] if others else None
    result = harness.measure("edit", "edit", shape=shape, references=[0, 1, 2, 3, PADDED], warm_shape=warm_shape)
    base, padded = result["rows"][0], result["rows"][-1]
    for row in result["rows"]:
        row["compile_over_0"] = ratio(row["compile_s"], base["compile_s"])
        row["latency_over_0"] = ratio(row["steady"]["median_s"], base["steady"]["median_s"])
        own = row["steady"]["median_s"] if row["references"] else None  # this many references on the padded graph
        row["padded_over_own"] = ratio(padded["steady"]["median_s"], own) if own else None
    return result | {"shape": shape, "steps": harness.cfg.steps, "warm_shape": warm_shape}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Per reference count at one output shape: the first call (compile + image), then the steady latency.

    References are images of the output's own size, so each snaps to that bucket: n references add n times the
    output's tokens to the transformer's sequence. The compiler's one-time start-up is paid beforehand on
    another shape, so the 0-reference compile is not inflated by it."""
    from PIL import Image

    shape, steps, repeats = spec["shape"], spec["steps"], spec["repeats"]
    res = Resolution.parse(shape)
    manager = worker_manager(spec)
    if spec.get("warm_shape"):
        manager.compile_shape(spec["warm_shape"])
    rows = []
    for count in spec["references"]:
        refs = [Image.new("RGB", (res.width, res.height), (60 * i % 256, 90, 200)) for i in range(count)] or None
        first_s, first = timed_generate(manager, shape, steps, 0, references=refs)
        graphs_before = manager.counter.graphs
        latencies = [timed_generate(manager, shape, steps, seed, references=refs)[0] for seed in range(1, repeats + 1)]
        row = {"references": count, "image_tokens": res.image_tokens * (count + 1), "graphs": first.graphs_compiled}
        row |= {"compile_s": first.compile_s, "first_image_s": first_s, "steady": summarize(latencies)}
        rows.append(row | {"steady_graphs": manager.counter.graphs - graphs_before})  # must be 0
    return facts(manager) | {"rows": rows}


COLUMNS = [
    ("references", "references"),
    ("image tokens", "image_tokens"),
    ("graphs", "graphs"),
    ("compile s", "compile_s", md.s),
    ("compile vs 0", "compile_over_0", md.x),
    ("first image s", "first_image_s", md.s),
    ("latency median ms", "steady.median_s", md.ms),
    ("latency p95 ms", "steady.p95_s", md.ms),
    ("latency vs 0", "latency_over_0", md.x),
    (f"padded to {PADDED} vs own", "padded_over_own", md.x),
    ("n", "steady.n"),
    ("recompiles after", "steady_graphs"),
]


def render(sec: dict[str, Any]) -> str:
    # A record from before the padded column (rows without padded_over_own) renders as it was measured.
    has_padded = all("padded_over_own" in r for r in sec["rows"])
    columns = [c for c in COLUMNS if c[1] != "padded_over_own" or has_padded]
    padded = (
        f" Padded to {PADDED} vs own: what an edit of that many references would take if every edit ran on one "
        f"{PADDED}-reference graph per shape (the layout padding would fix)."
        if has_padded
        else ""
    )
    warm = f" after the compiler's start-up was paid on {sec['warm_shape']}" if sec.get("warm_shape") else ""
    return (
        f"Output {sec['shape']}, {sec['steps']} steps, mode {sec['mode']} / {sec['backend']}, one process with an "
        f"empty cache folder{warm}. References are of the output's size (one bucket each), so each adds the "
        "output's image tokens to the transformer's sequence. Compile = the first call's compile; latency = "
        "`generate(..., references=...)` after it (reference preparation and VAE encoding included)."
        + padded
        + "\n\n"
        + md.columns(columns, sec["rows"])
    )
