"""Bench section `lora`: what a LoRA style switch costs beside a generation, as configured LoRAs grow.

One fresh process per adapter count (0 = no LoRA configured, the baseline without the slot), each with `tiny:<seed>`
adapters on the serving mode: the switch alone (`AdapterSet.activate`, timed in the process), a generation that does not
switch, a generation that switches on every call, and the graphs compiled after the shape's first compile (must be 0).

`python -m neuron_app.bench.sections.compiling.lora` (standalone, in this process): what each extra LoRA slot
costs, several styles at once. One manager per slot count (0 = no slot injected; k = `max_loras_per_request` k), the
shape compiled once, then generations with every slot filled (no switch), the switch that fills the k slots from
none, and the graphs compiled after the first compile (must be 0); as ratios to the slot-less server, in one run.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from neuron_app.bench import markdown as md
from neuron_app.bench import script
from neuron_app.bench.common import PROMPT, facts, seconds, summarize, timed_generate, worker_manager

KIND = "lora"
TITLE = "8. LoRA style switch"
SLOTS_TITLE = "LoRA slots: the cost of each extra style a request may combine"
#: Adapter counts measured (0 is the server without LoRA); the smoke run keeps two.
FULL_COUNTS = (0, 1, 4, 8)
SMOKE_COUNTS = (0, 2)
#: Direct switches timed per count (each a copy of the whole slot): cheap, so many.
SWITCHES = 50


def adapters_for(count: int) -> dict[str, str]:
    return {f"style{i}": f"tiny:{i + 1}" for i in range(count)}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
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
    result = {"loras": len(names), "target_rank": manager.settings.max_lora_rank, "load_s": status.load_s}
    result |= {"compile_s": outcome.compile_s, "generate": summarize(steady)}
    result |= {"generate_switching": summarize(switching), "switch_in_generate": summarize(in_call) if names else None}
    result |= {"switch": summarize(direct) if direct else None, "scale_only": summarize(scale_only) if names else None}
    return facts(manager) | result | {"graphs_after_compile": manager.counter.graphs - graphs_after_compile}  # 0


def section(harness: Any) -> dict[str, Any]:
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
    def ms(summary: dict[str, Any] | None, key: str = "median_s") -> str:
        return "-" if not summary else f"{summary[key] * 1000:.3f}"

    rows = []
    for run in sec["runs"]:
        share = "-"
        if run["switch"] and run["generate"]["median_s"]:
            share = f"{run['switch']['median_s'] / run['generate']['median_s']:.2%}"
        switch, gen = f"{ms(run['switch'])} / {ms(run['switch'], 'p95_s')}", ms(run["generate"])
        rows.append([run["loras"], switch, ms(run["scale_only"]), gen, ms(run["generate_switching"]), share])
        rows[-1] += [run["graphs_after_compile"], f"{run['load_s']:.2f}", f"{run['peak_rss_mb']:.0f}"]
    head = ["LoRAs", "switch ms (median / p95)", "scale-only ms", "generate ms, no switch", "generate ms, switching"]
    head += ["switch / generate", "graphs after first compile", "load s", "peak RSS MB"]
    first = sec["runs"][0]
    spread = sec.get("switch_spread")
    verdict = "OK" if sec["ok"] else "**WRONG: a switch recompiled**"
    return md.table(head, rows) + (
        f"\n\nMode {first['mode']} / {first['backend']}, target rank {first['target_rank']}, `tiny:<seed>` adapters. "
        "A switch copies the padded adapter into the one compiled slot (scale-only: fills the scaling tensors); "
        "0 LoRAs is the server without a slot. "
        + (f"Switch cost max/min across counts: {spread:.2f}x. " if spread else "")
        + f"No graph compiled after the shape's first compile: {verdict}."
    )


def measure_slots(slots: int, cache_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    extra = {"model": args.model, "compile_backend": args.backend, "max_loras_per_request": max(slots, 1)}
    manager = script.tiny_manager([args.shape], cache_dir, loras=adapters_for(slots), **extra)
    manager.compile_shape(args.shape)
    compiled = manager.status().compiles
    styles = [{"name": name, "scale": 0.8} for name in adapters_for(slots)]

    def generate(seed: int) -> None:
        manager.generate(PROMPT, args.shape, args.steps, seed, loras=styles)

    generate(0)  # the first call after a compile can be slower; it also fills the slots
    steady = seconds(generate, range(1, args.repeats + 1))
    switch: list[float] = []
    pairs = [(s["name"], s["scale"]) for s in styles]
    for _ in range(20 if slots else 0):  # the bench is this manager's only user: nothing holds the slots
        manager.adapters.activate("none", 1.0)
        switch.append(manager.adapters.activate_all(pairs))
    return {
        "slots": manager.adapters.slots,
        "generate": summarize(steady),
        "switch": summarize(switch) if switch else None,
        "graphs_after_compile": manager.status().compiles - compiled,
    }


def render_slots(runs: list[dict[str, Any]], command: str) -> str:
    base = runs[0]["generate"]["median_s"]
    rows, previous = [], base
    for run in runs:
        median = run["generate"]["median_s"]
        switch = "-" if not run["switch"] else f"{run['switch']['median_s'] * 1000:.3f}"
        added = "-" if run["slots"] == 0 else f"{(median - previous) / base:+.1%}"
        rows.append([run["slots"], f"{median * 1000:.1f}", f"{median / base:.3f}x", added, switch])
        rows[-1].append(run["graphs_after_compile"])
        previous = median
    ok = all(run["graphs_after_compile"] == 0 for run in runs)
    head = ["slots", "generate ms (median)", "vs 0 slots", "added by this slot", "fill all slots ms"]
    return md.table([*head, "graphs after compile"], rows) + (
        f"\n\n`{command}`. Each slot is a LoRA pair (rank `max_lora_rank`) on every adapted projection, always in "
        "the graph: its cost is paid by every request, styled or not. "
        + ("No graph compiled after each first compile." if ok else "**WRONG: something recompiled.**")
    )


def measure_all_slots(args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="lora-slots-") as folder:
        return [measure_slots(slots, args.cache_dir or Path(folder), args) for slots in range(args.max_slots + 1)]


def main(argv: list[str] | None = None) -> int:
    found = script.parser("sections.compiling.lora", __doc__, "also write the section (benchmarks/lora-slots.json)")
    found.add_argument("--model", default="tiny")
    found.add_argument("--backend", default="aot_eager", help="compile backend (inductor: the serving path)")
    found.add_argument("--shape", default="64x64")
    found.add_argument("--steps", type=int, default=2)
    found.add_argument("--repeats", type=int, default=8)
    found.add_argument("--max-slots", type=int, default=3)
    found.add_argument("--cache-dir", type=Path, help="the cache folder (default: a temporary one)")
    return script.main("sections.compiling.lora", SLOTS_TITLE, found, measure_all_slots, render_slots, argv)


if __name__ == "__main__":
    raise SystemExit(main())
