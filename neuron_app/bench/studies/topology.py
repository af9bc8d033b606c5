"""`python -m neuron_app.bench.studies.topology`: the plan's best topology per model and instance (issue 56).

For klein-4B and klein-9B at 1024x1024 on a trn2.3xlarge and a trn2.48xlarge: what `python -m neuron_app plan
--best` lays out (copies x TP x placement on aligned core blocks) and its instance images/s at the floor, beside
today's before this topology: copies of TP 1 only (several TP groups per instance were refused), the plan's
`instance_view` at TP 1. Floors are the plan's roofline lower bounds, not Trainium measurements.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from neuron_app.bench import markdown as md
from neuron_app.bench import script

TITLE = "Topology: the plan's best copies x TP x placement per instance, beside TP 1 copies only"
MODELS = ("klein-4b", "klein-9b")
SIZES = {"trn2.3xlarge": 4, "trn2.48xlarge": 64}  # logical cores at LNC=2


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from neuron_app.engine.model.real.best import best
    from neuron_app.engine.model.real.catalog import instance
    from neuron_app.engine.model.real.fit import plan_one
    from neuron_app.shapes import Resolution

    shape, trn2 = Resolution.parse(args.shape), instance("trn2", 2)
    rows = []
    for model in MODELS:
        for size, cores in SIZES.items():
            found = best(model, model, [shape], trn2, list(range(cores)))
            today = plan_one(model, model, shape, 1, trn2, 0, size)
            rows.append({
                "model": model,
                "instance_type": size,
                "topology": found,
                "tp1_copies": today["instance_view"]["replicas"],
                "tp1_placement": today["placement"]["setting"],
                "tp1_images_per_s_floor": today["instance_view"]["images_per_s_floor"],
            })  # fmt: skip
    return {"shape": args.shape, "rows": rows}


def render(results: dict[str, Any], command: str) -> str:
    rows = []
    for r in results["rows"]:
        t = r["topology"]
        blocks = ", ".join(str(b) for b in t["core_blocks"][:2]) + (", ..." if len(t["core_blocks"]) > 2 else "")
        gain = t["images_per_s_floor"] / r["tp1_images_per_s_floor"] if r["tp1_images_per_s_floor"] else None
        rows.append([
            r["model"],
            r["instance_type"],
            f"{t['copies']} x TP {t['tp']} `{t['placement']}`",
            blocks,
            md.s(t["floor_s_per_image"]),
            f"{t['images_per_s_floor']:g}",
            f"{r['tp1_copies']} x TP 1 `{r['tp1_placement']}`: {r['tp1_images_per_s_floor']:g}",
            f"{gain:.2f}x" if gain else "-",
        ])  # fmt: skip
    headers = ["model", "instance", "best topology", "core blocks", "floor s/image", "images/s floor"]
    headers += ["before: TP 1 copies only, images/s", "gain"]
    note = (
        f"\n\n{results['shape']}, bfloat16, 4 steps, 512 text tokens, LNC=2; floors are the plan's roofline lower "
        "bounds (docs/real-size.md), not measurements. Serve each with `NEURON_APP_REPLICAS=auto "
        "NEURON_APP_TP_DEGREE=auto python app.py` (docs/deploy-trn.md)."
    )
    return md.table(headers, rows) + note + f"\n\nCommand: `{command}`.\n"


def main(argv: list[str] | None = None) -> int:
    found = script.parser(
        "studies.topology",
        __doc__,
        "also write the section (benchmarks/topology.json)",
        Path("benchmarks/topology.json"),
    )
    found.add_argument("--shape", default="1024x1024")
    return script.main("studies.topology", TITLE, found, measure, render, argv)


if __name__ == "__main__":
    raise SystemExit(main())
