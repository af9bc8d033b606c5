"""`python -m neuron_app.bench.studies.emulated`: what the neuron code path compiles, counted on `neuron-emulated`.

Eager device ops compile a NEFF on first use per signature on Neuron; the emulator counts them exactly (op,
input shapes, dtypes). This measures, per shape in serving order: the first request's transformer graphs and
eager compiles, the next request's, a sibling of a token family, a step count other than the warmed one, and
everything again after a restart on the same cache folder.

`python -m neuron_app.bench.studies.emulated nki-shapes [--shapes A,B,...] [--json PATH]` says instead which shapes take
TorchNeuron's NKI attention kernel (second review, N1): each shape compiled once on the emulator (`max_sequence_length`
512 as served, one step), `nki_attention` read from the status: the gate evaluated on the traced graph with the real
token counts. The tiny model's 2 heads of dim 16 pass the gate's head and batch parts as klein-4B's 24 heads of dim
128 do. A yes/no per shape, nothing timed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from neuron_app.bench import markdown as md
from neuron_app.bench import script
from neuron_app.bench.common import timed_generate

#: A family-preserving small set: 128x64 and 64x128 share a token count (a family), 64x64 stands alone.
SHAPES = ["64x64", "128x64", "64x128"]
TITLE = "The neuron code path on neuron-emulated (eager compiles counted like NEFFs)"


def _manager(cache_dir: Path, variant: str) -> Any:
    return script.tiny_manager(
        SHAPES, cache_dir, model=variant, device="neuron-emulated", max_sequence_length=32, max_steps=8
    )


def measure(args: argparse.Namespace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-emulated-") as tmp:
        manager = _manager(Path(tmp), args.variant)

        def timed(label: str, shape: str, steps: int = 4, man: Any = manager) -> None:
            took, record = timed_generate(man, shape, steps, len(rows), "a lighthouse at dawn")
            row = {"request": label, "graphs": record.graphs_compiled, "eager_compiles": record.eager_compiles}
            rows.append(row | {"cache": str(record.cache), "seconds": round(took, 3)})

        timed("64x64, first request", "64x64")
        timed("64x64, second request", "64x64")
        timed("128x64, first request (new token count)", "128x64")
        timed("64x128, first request (sibling of 128x64)", "64x128")
        timed("64x128, second request", "64x128")
        timed("64x64, 7 steps (another step count)", "64x64", 7)
        rules = manager.status().neuron_rules
        restarted = _manager(Path(tmp), args.variant)
        for shape in SHAPES:
            timed(f"{shape} after a restart (warm cache)", shape, man=restarted)
    return {"rows": rows, "signatures": rules["eager_signatures"], "violations": rules["violation_count"]}


def render(result: dict[str, Any], _command: str) -> str:
    keys = ("request", "graphs", "eager_compiles", "cache")
    rows = [[*(r[k] for k in keys), f"{r['seconds']:.2f}"] for r in result["rows"]]
    notes = (
        f"\n\n{result['signatures']} distinct eager op signatures in all, {result['violations']} rule violations. "
        "On a trn2 each eager compile is a small neuronx-cc NEFF compile (unmeasured here); a sibling of a token "
        "family reuses the transformer graph and compiles only its per-shape glue. After a restart the graphs "
        "are traced again by dynamo (counted) but their artifacts and every eager signature come from the cache "
        "folder (`disk`, 0 eager compiles), as NEFFs do."
    )
    return md.table(["request", "transformer/VAE graphs", "eager compiles", "cache", "seconds"], rows) + notes


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["nki-shapes"]:
        return nki_main(argv[1:])
    where = Path("benchmarks/neuron-emulated.json")
    found = script.parser("studies.emulated", __doc__, "where the section goes", where)
    found.add_argument("--variant", default="tiny", choices=["tiny", "tiny-deep"])
    return script.main("studies.emulated", TITLE, found, measure, render, argv)


#: The default shapes before the third pass: six of seven miss the 512 multiple (4544 and 4464 joint tokens).
OLD_DEFAULTS = ["1024x1024", "1152x896", "896x1152", "1216x832", "832x1216", "1344x768", "768x1344"]


def nki_measure(shapes: list[str], cache_dir: Path) -> dict[str, dict[str, object]]:
    from neuron_app.shapes import Resolution

    manager = script.tiny_manager(shapes, cache_dir, device="neuron-emulated", max_sequence_length=512)
    rows: dict[str, dict[str, object]] = {}
    for shape in shapes:
        manager.compile_shape(shape)
        tokens = Resolution.parse(shape).image_tokens
        joint, nki = tokens + manager.settings.max_sequence_length, manager.status().shapes[shape].nki_attention
        rows[shape] = {"image_tokens": tokens, "joint_tokens": joint, "nki_attention": nki}
    return rows


def nki_main(argv: list[str]) -> int:
    from neuron_app.settings import load_settings

    parser = script.parser("studies.emulated nki-shapes", __doc__, "write the result here too")
    parser.add_argument("--shapes", help="comma-separated WIDTHxHEIGHT (default: the old and the new defaults)")
    args = parser.parse_args(argv)
    if args.shapes:
        groups = {"shapes": args.shapes.split(",")}
    else:
        groups = {"old defaults": OLD_DEFAULTS, "new defaults": list(load_settings(model="tiny").resolutions)}
    result = {}
    with tempfile.TemporaryDirectory(prefix="nki-shapes-") as folder:
        for name, shapes in groups.items():
            rows = nki_measure(shapes, Path(folder) / name.replace(" ", "-"))
            yes = sum(1 for r in rows.values() if r["nki_attention"])
            result[name] = {"shapes": rows, "nki": f"{yes} of {len(rows)}"}
            print(f"{name}: NKI attention at {yes} of {len(rows)} shapes")
            for shape, r in rows.items():
                print(f"  {shape:>9}  {r['joint_tokens']} joint tokens  nki_attention={r['nki_attention']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
