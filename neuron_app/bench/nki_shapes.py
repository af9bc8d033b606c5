"""Which shapes take TorchNeuron's NKI attention kernel, measured on neuron-emulated (second review, N1).

`python -m neuron_app.bench.nki_shapes [--shapes A,B,...] [--json PATH]` compiles each shape once on the
emulator (the tiny model, `max_sequence_length` 512 as served, one step) and reads `nki_attention` from the
status: the gate evaluated on the transformer's traced graph, with the real token counts (image tokens +
512 text tokens); the tiny model's 2 heads of dim 16 pass the head and batch parts of the gate as klein-4B's
24 heads of dim 128 do. Compiles nothing on a device and times nothing: a yes/no per shape.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from neuron_app.bench import script

#: The default shapes before the third pass: six of seven miss the 512 multiple (4544 and 4464 joint tokens).
OLD_DEFAULTS = ["1024x1024", "1152x896", "896x1152", "1216x832", "832x1216", "1344x768", "768x1344"]


def measure(shapes: list[str], cache_dir: Path) -> dict[str, dict[str, object]]:
    from neuron_app.shapes import Resolution

    manager = script.tiny_manager(shapes, cache_dir, device="neuron-emulated", max_sequence_length=512)
    rows: dict[str, dict[str, object]] = {}
    for shape in shapes:
        manager.compile_shape(shape)
        image_tokens = Resolution.parse(shape).image_tokens
        row = manager.status().shapes[shape]
        rows[shape] = {
            "image_tokens": image_tokens,
            "joint_tokens": image_tokens + manager.settings.max_sequence_length,
            "nki_attention": row.nki_attention,
        }
    return rows


def main(argv: list[str] | None = None) -> int:
    from neuron_app.settings import load_settings

    parser = script.parser("nki_shapes", __doc__, "write the result here too")
    parser.add_argument("--shapes", help="comma-separated WIDTHxHEIGHT (default: the old and the new defaults)")
    args = parser.parse_args(argv)
    if args.shapes:
        groups = {"shapes": args.shapes.split(",")}
    else:
        groups = {"old defaults": OLD_DEFAULTS, "new defaults": list(load_settings(model="tiny").resolutions)}
    result = {}
    with tempfile.TemporaryDirectory(prefix="nki-shapes-") as folder:
        for name, shapes in groups.items():
            rows = measure(shapes, Path(folder) / name.replace(" ", "-"))
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
