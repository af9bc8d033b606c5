"""What the safety checker and the AI-content marks cost per image, beside a generation on the same machine.

    python -m neuron_app.bench.safety [--sizes 256 512 1024] [--repeats 5] [--json benchmarks/safety.json]
    python -m neuron_app.bench render --benchmarks BENCHMARKS.md     # the JSON becomes a BENCHMARKS.md section

Prints Markdown tables. Measured through the app's own code:
`SafetyChecker.score` (what `check` runs) on a ViT-B/16 at 224x224 with random weights (the architecture,
preprocessing and so the cost of the default Falconsai/nsfw_image_detection, which cannot be downloaded here)
and on the tiny stand-in;
`Marker.encode` (watermark embedded and read back, PNG with text and XMP, C2PA signed with the local chain) and
its parts, against the plain PNG the app wrote before; and `manager.generate` of the tiny-deep model (the real
block structure at tiny width, so its time says little about the real 4B model, which needs the device).
All on the host CPU, where these steps run in the server.
"""

from __future__ import annotations

import argparse
import io
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from neuron_app.bench import markdown as md
from neuron_app.bench import script
from neuron_app.bench.common import PROMPT, percentile

TITLE = "Safety checker and AI-content marks, per image (host CPU)"
#: tiny-deep generations are timed up to this side: larger ones take minutes of a shared 2-core CPU.
GENERATE_MAX_SIDE = 256


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """(CPU, wall) seconds, medians of `repeats` calls after one warm-up call. The CPU time of this process (all
    its threads) is the step's own work whatever else runs on the machine; the wall time is what a request waited
    here, contention included."""
    fn()
    cpu, wall = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        cpu.append(time.process_time() - start_cpu)
        wall.append(time.perf_counter() - start)
    return percentile(cpu, 50), percentile(wall, 50)


def vit_b16(folder: Path) -> Path:
    """A ViT-B/16 classifier (normal/nsfw) with random weights, saved like a Hub checkpoint."""
    from transformers import ViTConfig, ViTForImageClassification
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    labels = {0: "normal", 1: "nsfw"}
    config = ViTConfig(id2label=labels, label2id={v: k for k, v in labels.items()})  # defaults: ViT-B/16, 224
    ViTForImageClassification(config).eval().save_pretrained(folder)
    processor = ViTImageProcessorPil(size={"height": 224, "width": 224}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor.save_pretrained(folder)
    return folder


def images(size: int) -> dict[str, Any]:
    """Noise (what the tiny model draws) and a photo-like image (smooth areas: the watermark's harder case)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(size)
    noise = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
    coarse = Image.fromarray(rng.integers(0, 256, (size // 8, size // 8, 3), dtype=np.uint8))
    return {"noise": noise, "photo-like": coarse.resize((size, size), Image.Resampling.BICUBIC)}


def record_for(image: Any) -> Any:
    from neuron_app.engine.records import CacheResult, GenerationRecord

    side = f"{image.size[0]}x{image.size[1]}"
    return GenerationRecord(side, 4, 0, PROMPT, CacheResult.MEMORY, False, 0.0, 0.0, 0.0, 0, "bench", image=image)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-safety-") as tmp:
        return measure_in(args.sizes, args.repeats, Path(tmp))


def measure_in(sizes: list[int], repeats: int, cache: Path) -> dict[str, Any]:
    from neuron_app.engine.images import provenance
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.engine.trust.c2pa_signing import ManifestSigner, signing_key
    from neuron_app.engine.trust.marks import Marker, add_watermark, embed_watermark, read_watermark
    from neuron_app.engine.trust.safety import SafetyChecker

    shapes = [f"{s}x{s}" for s in sizes]

    def settings_with(**extra: Any) -> Any:
        return script.tiny_settings(shapes, cache, model="tiny-deep", max_sequence_length=32, **extra)

    settings = settings_with()
    checkers = {
        "ViT-B/16 (Falconsai's architecture)": SafetyChecker(
            settings_with(safety_checker="on", safety_model=str(vit_b16(cache / "vit-b16")))
        ),
        "tiny stand-in": SafetyChecker(settings_with(safety_checker="on", safety_model="tiny")),
    }
    marker = Marker(settings)
    signer = ManifestSigner(signing_key(None, None, None, cache))
    rows: dict[str, Any] = {"safety": [], "marks": [], "generate": []}
    for size in sizes:
        for name, checker in checkers.items():
            image = images(size)["noise"]
            rows["safety"].append((f"{size}x{size}", name, timed(lambda c=checker, i=image: c.score(i), repeats)))
        for kind, image in images(size).items():
            record = record_for(image)
            text = provenance(record)

            def plain(image: Any = image) -> bytes:
                buffer = io.BytesIO()
                image.save(buffer, format="PNG", compress_level=1)
                return buffer.getvalue()

            png = plain()
            held = embed_watermark(image, marker.payload) is not None
            one_pass_holds = read_watermark(add_watermark(image, marker.payload)) == marker.payload
            manifest = marker.manifest(record, "2026-01-01T00:00:00Z")
            rows["marks"].append(
                {
                    "shape": f"{size}x{size}",
                    "image": kind,
                    "plain_png": timed(plain, repeats),
                    "watermark": timed(lambda i=image: embed_watermark(i, marker.payload), repeats),
                    "c2pa": timed(lambda p=png, m=manifest: signer.sign(p, m), repeats),
                    "all": timed(lambda r=record, t=text: marker.encode(r, t), repeats),
                    "held": "yes" if held else "no",
                    "one_pass": "yes" if one_pass_holds else "no (a second pass)",
                    "bytes": (len(png), len(marker.encode(record, text))),
                }
            )
    manager = PipelineManager(settings)
    manager.ensure_loaded()
    for size in [s for s in sizes if s <= GENERATE_MAX_SIDE]:
        shape = f"{size}x{size}"
        manager.compile_shape(shape)
        rows["generate"].append((shape, timed(lambda s=shape: manager.generate(PROMPT, s, 4, 0), max(1, repeats // 2))))
    return rows


def render(rows: dict[str, Any], command: str) -> str:
    def ms(pair: tuple[float, float]) -> str:
        return f"{pair[0] * 1000:.0f} ({pair[1] * 1000:.0f})"

    marks = []
    for m in rows["marks"]:
        times = [ms(m[k]) for k in ("plain_png", "watermark", "c2pa", "all")]
        marks.append([m["shape"], m["image"], *times, m["held"], m["one_pass"], f"{m['bytes'][0]} / {m['bytes'][1]}"])
    marks_head = ["shape", "image", "plain PNG (ms)", "watermark, embed + read back (ms)", "C2PA sign (ms)"]
    marks_head += ["all marks (ms)", "holds", "one pass enough", "PNG bytes plain / marked"]
    return "\n\n".join(
        [
            script.host(command) + " Milliseconds per image: CPU time of the process, all threads (wall time in "
            "brackets; on a shared machine the CPU time is the step's own cost, the wall time includes the waiting).",
            md.table(["shape", "tiny-deep generate, 4 steps (ms)"], [[shape, ms(s)] for shape, s in rows["generate"]]),
            md.table(
                ["shape", "safety classifier", "check per image (ms)"],
                [[shape, name, ms(s)] for shape, name, s in rows["safety"]],
            ),
            md.table(marks_head, marks),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    found = script.parser(
        "safety", __doc__, "also write the tables here (benchmarks/safety.json: a section of BENCHMARKS.md)"
    )
    found.add_argument("--sizes", nargs="+", type=int, default=[256, 512, 1024], help="square sides (multiples of 16)")
    found.add_argument("--repeats", type=int, default=5)
    return script.main("safety", TITLE, found, measure, render, argv)


if __name__ == "__main__":
    raise SystemExit(main())
