"""Bench section `lora`: what a LoRA style switch costs beside a generation, as configured LoRAs grow.

One fresh process per adapter count (0 = no LoRA configured, the baseline without the slot), each
with `tiny:<seed>` adapters on the serving mode: the switch alone (`AdapterSet.activate`, timed in
the process), a generation that does not switch, a generation that switches on every call, and the
graphs compiled after the shape's first compile (must be 0).
"""

from __future__ import annotations

from typing import Any

from neuron_app.bench.common import facts, summarize, timed_generate, worker_manager

KIND = "lora"
TITLE = "8. LoRA style switch"
#: Adapter counts measured (0 is the server without LoRA); the smoke run keeps two.
FULL_COUNTS = (0, 1, 4, 8)
SMOKE_COUNTS = (0, 2)
#: Direct switches timed per count (each a copy of the whole slot): cheap, so many.
SWITCHES = 50


def adapters_for(count: int) -> dict[str, str]:
    return {f"style{i}": f"tiny:{i + 1}" for i in range(count)}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """The worker side (`kind: lora`): runs in its own process."""
    manager = worker_manager(spec)
    shape, steps, repeats = spec["shape"], spec["steps"], spec["repeats"]
    outcome = manager.compile_shape(shape)
    names = manager.adapters.names
    cycle = ["none", *names]
    graphs_after_compile = manager.counter.graphs

    def timed(lora: str, seed: int, scale: float = 1.0) -> tuple[float, Any]:
        return timed_generate(manager, shape, steps, seed, lora=lora, lora_scale=scale)

    timed(names[-1] if names else "none", 0)  # warm: the first call after a compile can be slower
    steady = [timed(names[-1] if names else "none", seed)[0] for seed in range(1, repeats + 1)]
    switching, in_call = [], []
    for i in range(repeats):
        elapsed, record = timed(cycle[i % len(cycle)] if names else "none", 0, 1.0 - 0.1 * (i % 2))
        switching.append(elapsed)
        in_call.append(record.lora_switch_s)
    direct: list[float] = []
    scale_only: list[float] = []
    if names:
        # The bench process is the only user of this manager: no request can hold the slot meanwhile.
        for i in range(SWITCHES):
            direct.append(manager.adapters.activate(names[i % len(names)], 1.0))  # a copy of the whole slot
            scale_only.append(manager.adapters.activate(names[i % len(names)], 0.5))  # scaling tensors only
            manager.adapters.activate("none", 1.0)
    status = manager.status()
    return facts(manager) | {
        "loras": len(names),
        "target_rank": manager.settings.max_lora_rank,
        "load_s": status.load_s,
        "compile_s": outcome.compile_s,
        "generate": summarize(steady),
        "generate_switching": summarize(switching),
        "switch_in_generate": summarize(in_call) if names else None,
        "switch": summarize(direct) if direct else None,
        "scale_only": summarize(scale_only) if scale_only else None,
        "graphs_after_compile": manager.counter.graphs - graphs_after_compile,  # must be 0
    }


def section(harness: Any) -> dict[str, Any]:
    """The orchestrator side: one worker per adapter count, each in a fresh cache folder."""
    counts = SMOKE_COUNTS if harness.cfg.smoke else FULL_COUNTS
    shape, repeats = harness.cfg.shapes[0], max(2, harness.cfg.repeats)
    runs = [
        harness.measure(f"lora-{n}", "lora", None, {"loras": adapters_for(n)}, shape=shape, repeats=repeats)
        for n in counts
    ]
    switches = [r["switch"]["median_s"] for r in runs if r["switch"]]
    return {
        "runs": runs,
        "ok": all(r["graphs_after_compile"] == 0 for r in runs),
        "switch_spread": (max(switches) / min(switches)) if switches and min(switches) > 0 else None,
    }


def render(sec: dict[str, Any]) -> str:
    """The markdown table for BENCHMARKS.md."""

    def ms(summary: dict[str, Any] | None, key: str = "median_s") -> str:
        return "-" if not summary else f"{summary[key] * 1000:.3f}"

    lines = [
        "| LoRAs | switch ms (median / p95) | scale-only ms | generate ms, no switch | generate ms, switching "
        "| switch / generate | graphs after first compile | load s | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in sec["runs"]:
        share = "-"
        if run["switch"] and run["generate"]["median_s"]:
            share = f"{run['switch']['median_s'] / run['generate']['median_s']:.2%}"
        lines.append(
            f"| {run['loras']} | {ms(run['switch'])} / {ms(run['switch'], 'p95_s')} | {ms(run['scale_only'])} "
            f"| {ms(run['generate'])} | {ms(run['generate_switching'])} | {share} | {run['graphs_after_compile']} "
            f"| {run['load_s']:.2f} | {run['peak_rss_mb']:.0f} |"
        )
    first = sec["runs"][0]
    spread = sec.get("switch_spread")
    verdict = "OK" if sec["ok"] else "**WRONG: a switch recompiled**"
    lines.append(
        f"\nMode {first['mode']} / {first['backend']}, target rank {first['target_rank']}, `tiny:<seed>` adapters. "
        "A switch copies the padded adapter into the one compiled slot (scale-only: fills the scaling tensors); "
        "0 LoRAs is the server without a slot. "
        + (f"Switch cost max/min across counts: {spread:.2f}x. " if spread else "")
        + f"No graph compiled after the shape's first compile: {verdict}."
    )
    return "\n".join(lines)
