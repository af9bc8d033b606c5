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
import time
from pathlib import Path
from typing import Any

from neuron_app.bench.common import PROMPT, summarize
from neuron_app.bench.markdown import standalone, write_section

TITLE = "LoRA slots: the cost of each extra style a request may combine"
ADAPTERS = {"a": "tiny:1", "b": "tiny:2", "c": "tiny:3"}


def measure(slots: int, cache_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One slot count: a fresh manager, its compile, `repeats` generations with every slot filled, the switch."""
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.settings import load_settings

    overrides: dict[str, Any] = {
        "model": args.model,
        "device": "cpu",
        "compile_backend": args.backend,
        "resolutions": [args.shape],
        "default_resolution": args.shape,
        "cache_dir": cache_dir,
        "loras": dict(list(ADAPTERS.items())[: max(slots, 1)]) if slots else {},
        "max_loras_per_request": max(slots, 1),
    }
    manager = PipelineManager(load_settings(**overrides))
    manager.ensure_loaded()
    manager.compile_shape(args.shape)
    compiled = manager.status().compiles
    styles = [{"name": name, "scale": 0.8} for name in list(ADAPTERS)[:slots]]

    def generate(seed: int) -> float:
        start = time.perf_counter()
        manager.generate(PROMPT, args.shape, args.steps, seed, loras=styles)
        return time.perf_counter() - start

    generate(0)  # the first call after a compile can be slower; it also fills the slots
    steady = [generate(seed) for seed in range(1, args.repeats + 1)]
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
    lines = [
        "| slots | generate ms (median) | vs 0 slots | added by this slot | fill all slots ms | graphs after compile |",
        "|---|---|---|---|---|---|",
    ]
    previous = base
    for run in runs:
        median = run["generate"]["median_s"]
        switch = "-" if not run["switch"] else f"{run['switch']['median_s'] * 1000:.3f}"
        added = "-" if run["slots"] == 0 else f"{(median - previous) / base:+.1%}"
        lines.append(
            f"| {run['slots']} | {median * 1000:.1f} | {median / base:.3f}x | {added} | {switch} "
            f"| {run['graphs_after_compile']} |"
        )
        previous = median
    ok = all(run["graphs_after_compile"] == 0 for run in runs)
    lines.append(
        f"\n`{command}`. Each slot is a LoRA pair (rank `max_lora_rank`) on every adapted projection, always in the "
        "graph: its cost is paid by every request, styled or not. "
        + ("No graph compiled after each first compile." if ok else "**WRONG: something recompiled.**")
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m neuron_app.bench.lora_slots", description=__doc__)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--backend", default="aot_eager", help="compile backend (inductor: the serving path)")
    parser.add_argument("--shape", default="64x64")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--max-slots", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the section (benchmarks/lora-slots.json)")
    parser.add_argument("--cache-dir", type=Path, help="the cache folder (default: a temporary one)")
    args = parser.parse_args(argv)
    command, started = standalone("neuron_app.bench.lora_slots", argv)
    with tempfile.TemporaryDirectory(prefix="lora-slots-") as folder:
        cache_dir = args.cache_dir or Path(folder)
        runs = [measure(slots, cache_dir, args) for slots in range(args.max_slots + 1)]
    markdown = render(runs, command)
    print(markdown)
    if args.json:
        write_section(args.json, TITLE, command, started, markdown, runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
