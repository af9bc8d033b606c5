"""`python -m neuron_app.bench.studies.real_size`: klein at its real size on `neuron-emulated`, through the manager.

The real architecture with random bfloat16 weights (`klein-4b-random`, engine/model/real/random_weights.py), built
once into the cache folder, loaded by the same `from_pretrained` as the real model, compiled and served one image at
the smallest shape with a short text. Recorded: the build and load seconds, the compile, seconds per step on this
host's CPU (not a Trainium figure: the plan's roofline floor is that), the peak RSS of this process, and the HBM per
core the emulator counted beside what `python -m neuron_app plan` predicts for the same weights.
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from neuron_app.bench import markdown as md
from neuron_app.bench import script

TITLE = "Real size: klein-4B's architecture with random weights on neuron-emulated"
TITLE_PLACED = "Real size on 10 GiB cores: placement auto puts the text encoder on a core of its own"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from neuron_app.environment import prepare_process
    from neuron_app.settings import load_settings

    fields: dict[str, Any] = {"model": args.model, "device": "neuron-emulated", "dtype": "bfloat16"}
    fields |= {"resolutions": [args.shape], "default_resolution": args.shape, "max_sequence_length": args.text_tokens}
    fields |= {"compile_backend": "aot_eager", "max_steps": max(args.steps, 4)}
    if args.cache_dir:
        fields["cache_dir"] = args.cache_dir
    if args.hbm_gib:  # a smaller emulated core over two: `placement = "auto"` chooses (issue 50, klein-9B's case)
        os.environ["NEURON_EMULATOR_HBM_GIB"] = f"{args.hbm_gib:g}"
        os.environ["NEURON_RT_VISIBLE_CORES"] = "0-1"
    settings = load_settings(**fields)
    prepare_process(settings)
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.engine.model.loader import resolve_source
    from neuron_app.engine.model.real.random_weights import ensure_random

    source = resolve_source(settings)
    started = time.perf_counter()
    ensure_random(settings.cache_dir / "models", args.model)
    build_s = time.perf_counter() - started
    manager = PipelineManager(settings)
    started = time.perf_counter()
    manager.ensure_loaded()
    load_s = time.perf_counter() - started
    stamps: list[float] = []
    record = manager.generate(
        "a red circle", args.shape, args.steps, 7,
        progress=lambda e: stamps.append(time.perf_counter()) if e.phase == "denoising" else None,
    )  # fmt: skip
    emulator = manager.backend.emulator.snapshot()
    gib = 2**30
    weights = {name: _weights(getattr(manager.pipe, name)) / gib for name in ("transformer", "text_encoder", "vae")}
    return {
        "model": args.model,
        "identity": source.identity,
        "shape": args.shape,
        "steps": args.steps,
        "text_tokens": args.text_tokens,
        "build_s": round(build_s, 1),
        "load_s": round(load_s, 1),
        "compile_s": round(record.compile_s, 1),
        "inference_s": round(record.inference_s, 1),
        "step_s": round(statistics.median(b - a for a, b in itertools.pairwise(stamps)), 2)
        if len(stamps) > 1
        else None,
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "weights_gib": {k: round(v, 3) for k, v in weights.items()},
        "hbm_in_use_gib": emulator.get("hbm_in_use_gib"),
        "hbm_peak_gib": emulator.get("hbm_peak_gib"),
        "hbm_gib_per_core": emulator.get("hbm_gib"),
        "placement": manager.status().placement,
        "devices": manager.backend.emulator.devices(),
        "plan": _plan(args.model, args.shape),
    }


def _weights(module: Any) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in module.parameters()}.values())


def _plan(model: str, shape: str) -> dict[str, Any]:
    """What `python -m neuron_app plan --model MODEL --shape SHAPE --tp 1 --instance trn2` says of the same weights."""
    from neuron_app.engine.model.real.catalog import instance, spec_name
    from neuron_app.engine.model.real.fit import plan_one
    from neuron_app.shapes import Resolution

    row = plan_one(spec_name(model), model, Resolution.parse(shape), 1, instance("trn2"))
    weights = sum(c["weights_gib_per_core"] for c in row["components"].values())
    return {"weights_gib": round(weights, 3), "total_gib_per_core": row["total_gib_per_core"]}


def render(results: dict[str, Any], command: str) -> str:
    r = results
    rows = [
        ["model", f"`{r['model']}` ({r['shape']}, {r['steps']} steps, {r['text_tokens']} text tokens, bfloat16)"],
        ["build the random folder (first use), s", md.s(r["build_s"])],
        ["load (from_pretrained, cut text encoder), s", md.s(r["load_s"])],
        ["compile (aot_eager standing in for neuronx-cc), s", md.s(r["compile_s"])],
        ["seconds per step on this host's CPU, s", md.s(r["step_s"]) if r["step_s"] is not None else "-"],
        ["peak RSS of the process", f"{r['peak_rss_gib']} GiB"],
        ["weights: transformer / text encoder / VAE", " / ".join(f"{v} GiB" for v in r["weights_gib"].values())],
        [
            "emulator HBM: in use, peak (every core together); capacity per core"
            if r.get("placement")
            else "emulator HBM per core: in use, peak, capacity",
            f"{r['hbm_in_use_gib']} / {r['hbm_peak_gib']} / {r['hbm_gib_per_core']} GiB",
        ],
        ["the plan's weights, every component (trn2, TP 1)", f"{r['plan']['weights_gib']} GiB"],
    ]  # fmt: skip
    if r.get("placement"):
        placed = r["placement"]
        rows.append(["placement", f"`{placed['name']}` ({placed['why']})"])
        rows.append([
            "per core: in use / peak",
            "; ".join(f"neuron:{d['index']} {d['in_use_gib']} / {d['peak_gib']} GiB" for d in r.get("devices", [])),
        ])  # fmt: skip
    return md.table(["", "measured"], rows) + f"\n\nCommand: `{command}`.\n"


def main(argv: list[str] | None = None) -> int:
    found = script.parser(
        "studies.real_size",
        __doc__,
        "also write the section (benchmarks/real-size.json)",
        Path("benchmarks/real-size.json"),
    )
    found.add_argument("--model", default="klein-4b-random", choices=["klein-4b-random", "klein-9b-random"])
    found.add_argument("--shape", default="64x64")
    found.add_argument("--steps", type=int, default=4)
    found.add_argument("--text-tokens", type=int, default=16)
    found.add_argument(
        "--hbm-gib", type=float, default=None, help="emulated HBM per core over two cores (placement auto chooses)"
    )
    found.add_argument(
        "--cache-dir", type=Path, default=None, help="where the random folder is built (default: the settings')"
    )
    placed = "--hbm-gib" in (sys.argv if argv is None else argv)
    return script.main("studies.real_size", TITLE_PLACED if placed else TITLE, found, measure, render, argv)


if __name__ == "__main__":
    raise SystemExit(main())
