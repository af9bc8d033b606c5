"""`python -m neuron_app.bench.emulated`: what the neuron code path compiles, counted on `neuron-emulated`.

Eager device ops compile a NEFF on first use per signature on Neuron; the emulator counts them exactly (op,
input shapes, dtypes). This measures, per shape in serving order: the first request's transformer graphs and
eager compiles, the next request's, a sibling of a token family, a step count other than the warmed one, and
everything again after a restart on the same cache folder. Writes `benchmarks/neuron-emulated.json`, which
`python -m neuron_app.bench render` turns into a section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

#: A family-preserving small set: 128x64 and 64x128 share a token count (a family), 64x64 stands alone.
SHAPES = ["64x64", "128x64", "64x128"]
COMMAND = "python -m neuron_app.bench.emulated"


def _manager(cache_dir: Path, variant: str) -> Any:
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.settings import load_settings

    settings = load_settings(
        model=variant,
        device="neuron-emulated",
        compile_backend="aot_eager",
        resolutions=SHAPES,
        default_resolution=SHAPES[0],
        max_sequence_length=32,
        max_steps=8,
        cache_dir=cache_dir,
    )
    return PipelineManager(settings)


def _row(label: str, record: Any, seconds: float) -> dict[str, Any]:
    return {
        "request": label,
        "graphs": record.graphs_compiled,
        "eager_compiles": record.eager_compiles,
        "cache": str(record.cache),
        "seconds": round(seconds, 3),
    }


def measure(variant: str = "tiny") -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-emulated-") as tmp:
        cache = Path(tmp)
        manager = _manager(cache, variant)
        manager.ensure_loaded()

        def timed(label: str, shape: str, steps: int = 4, man: Any = manager) -> None:
            start = time.perf_counter()
            record = man.generate("a lighthouse at dawn", shape, steps, len(rows))
            rows.append(_row(label, record, time.perf_counter() - start))

        timed("64x64, first request", "64x64")
        timed("64x64, second request", "64x64")
        timed("128x64, first request (new token count)", "128x64")
        timed("64x128, first request (sibling of 128x64)", "64x128")
        timed("64x128, second request", "64x128")
        timed("64x64, 7 steps (another step count)", "64x64", 7)
        rules = manager.status().neuron_rules
        restarted = _manager(cache, variant)
        restarted.ensure_loaded()
        for shape in SHAPES:
            timed(f"{shape} after a restart (warm cache)", shape, man=restarted)
    return {"rows": rows, "signatures": rules["eager_signatures"], "violations": rules["violation_count"]}


def markdown(result: dict[str, Any]) -> str:
    head = "| request | transformer/VAE graphs | eager compiles | cache | seconds |\n|---|---|---|---|---|"
    lines = [
        f"| {r['request']} | {r['graphs']} | {r['eager_compiles']} | {r['cache']} | {r['seconds']:.2f} |"
        for r in result["rows"]
    ]
    notes = (
        f"\n\n{result['signatures']} distinct eager op signatures in all, {result['violations']} rule violations. "
        "On a trn2 each eager compile is a small neuronx-cc NEFF compile (unmeasured here); a sibling of a token "
        "family reuses the transformer graph and compiles only its per-shape glue. After a restart the graphs "
        "are traced again by dynamo (counted) but their artifacts and every eager signature come from the cache "
        "folder (`disk`, 0 eager compiles), as NEFFs do."
    )
    return "\n".join([head, *lines]) + notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="tiny", choices=["tiny", "tiny-deep"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/neuron-emulated.json"))
    args = parser.parse_args(argv)
    result = measure(args.variant)
    doc = {
        "title": "The neuron code path on neuron-emulated (eager compiles counted like NEFFs)",
        "command": COMMAND + (f" --variant {args.variant}" if args.variant != "tiny" else ""),
        "started_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "result": result,
        "markdown": markdown(result),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(doc["markdown"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
