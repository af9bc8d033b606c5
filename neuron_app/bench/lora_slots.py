"""`python -m neuron_app.bench.lora_slots`: what each extra LoRA slot costs (several styles at once).

One manager per slot count (0 = no adapters: no slot injected; k = `max_loras_per_request` k over three
`tiny:<seed>` adapters), in this process, one after another: the shape compiled once, then generations with
every slot filled (the same styles each time: no switch), the switch that fills the k slots from none, and the
graphs compiled after the first compile (must be 0). Figures as ratios to the slot-less server, measured in one
run. `--json PATH` also writes the section for BENCHMARKS.md (`python -m neuron_app.bench render`).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from neuron_app.bench import markdown as md
from neuron_app.bench import script
from neuron_app.bench.common import PROMPT, seconds, summarize

TITLE = "LoRA slots: the cost of each extra style a request may combine"
ADAPTERS = {"a": "tiny:1", "b": "tiny:2", "c": "tiny:3"}


def measure_slots(slots: int, cache_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One slot count: a fresh manager, its compile, `repeats` generations with every slot filled, the switch."""
    loras = dict(list(ADAPTERS.items())[: max(slots, 1)]) if slots else {}
    extra = {"model": args.model, "compile_backend": args.backend, "max_loras_per_request": max(slots, 1)}
    manager = script.tiny_manager([args.shape], cache_dir, loras=loras, **extra)
    manager.compile_shape(args.shape)
    compiled = manager.status().compiles
    styles = [{"name": name, "scale": 0.8} for name in list(ADAPTERS)[:slots]]

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


def render(runs: list[dict[str, Any]], command: str) -> str:
    base = runs[0]["generate"]["median_s"]
    rows, previous = [], base
    for run in runs:
        median = run["generate"]["median_s"]
        switch = "-" if not run["switch"] else f"{run['switch']['median_s'] * 1000:.3f}"
        added = "-" if run["slots"] == 0 else f"{(median - previous) / base:+.1%}"
        graphs = run["graphs_after_compile"]
        rows.append([run["slots"], f"{median * 1000:.1f}", f"{median / base:.3f}x", added, switch, graphs])
        previous = median
    ok = all(run["graphs_after_compile"] == 0 for run in runs)
    head = [
        "slots",
        "generate ms (median)",
        "vs 0 slots",
        "added by this slot",
        "fill all slots ms",
        "graphs after compile",
    ]
    lines = [md.table(head, rows)]
    lines.append(
        f"\n`{command}`. Each slot is a LoRA pair (rank `max_lora_rank`) on every adapted projection, always in the "
        "graph: its cost is paid by every request, styled or not. "
        + ("No graph compiled after each first compile." if ok else "**WRONG: something recompiled.**")
    )
    return "\n".join(lines)


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="lora-slots-") as folder:
        cache_dir = args.cache_dir or Path(folder)
        return [measure_slots(slots, cache_dir, args) for slots in range(args.max_slots + 1)]


def main(argv: list[str] | None = None) -> int:
    found = script.parser("lora_slots", __doc__, "also write the section (benchmarks/lora-slots.json)")
    found.add_argument("--model", default="tiny")
    found.add_argument("--backend", default="aot_eager", help="compile backend (inductor: the serving path)")
    found.add_argument("--shape", default="64x64")
    found.add_argument("--steps", type=int, default=2)
    found.add_argument("--repeats", type=int, default=8)
    found.add_argument("--max-slots", type=int, default=3)
    found.add_argument("--cache-dir", type=Path, help="the cache folder (default: a temporary one)")
    return script.main("lora_slots", TITLE, found, measure, render, argv)


if __name__ == "__main__":
    raise SystemExit(main())
