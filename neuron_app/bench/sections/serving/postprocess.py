"""Bench section `postprocess`: the host work after the device, per stage, and what the post stage gives the lane.

One worker on `neuron-emulated`: each host stage's milliseconds on one thread (the safety classifier, a random
ViT-B/16 at the default model's shape, batch 1 and 4; the watermark; PNG at Pillow's level 6 and 1, the app's PNG
(libpng through imagecodecs: level 1, Z_RLE, Paeth rows), JPEG, WebP; the C2PA signature), then 8 queued requests
with the post stage overlapped and in-line, safety on and off, and last with the classifier on the device
(`safety_device = "device"`: the lane runs its graph). On two cores the host work and the emulated device share the
CPU: the lane's idle fraction is the figure that does not depend on it.
"""

from __future__ import annotations

import datetime
import functools
import io
import itertools
import os
import threading
import time
from typing import Any

from neuron_app.bench import markdown as md
from neuron_app.bench.common import PROMPT, loaded_manager, ratio, seconds, summarize

KIND = "postprocess"
TITLE = "12. Post-processing: the host work after the device"
SIDES = (256, 512, 1024)
QUEUE = 8


def _vit_b16(folder: Any) -> str:
    """A ViT-B/16 classifier (224 px, labels normal/nsfw) saved like a Hub model; the head says normal."""
    import torch
    from transformers import ViTConfig, ViTForImageClassification
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    config = ViTConfig(id2label={0: "normal", 1: "nsfw"}, label2id={"normal": 0, "nsfw": 1})
    model = ViTForImageClassification(config).eval()
    with torch.no_grad():
        model.classifier.weight.zero_()
        model.classifier.bias.copy_(torch.tensor([8.0, -8.0]))
    model.save_pretrained(folder)
    ViTImageProcessorPil(size={"height": 224, "width": 224}).save_pretrained(folder)
    return str(folder)


def _timed(fn: Any, repeats: int) -> dict[str, Any]:
    fn()  # warm
    return summarize(seconds(lambda _: fn(), range(repeats)))


def _stages(manager: Any, repeats: int, sides: list[int], record: Any) -> list[dict[str, Any]]:
    """Each stage on one thread; the C2PA signature over the manifest the app signs for `record`."""
    import torch

    from neuron_app.engine.trust import marks

    torch.set_num_threads(1)
    marker = marks.Marker.for_settings(manager.settings)
    manifest = marker.manifest(record, datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    return [_stage_row(side, manager.safety, marker, manifest, repeats) for side in sides]


def _stage_row(side: int, safety: Any, marker: Any, manifest: dict[str, Any], repeats: int) -> dict[str, Any]:
    import numpy as np
    from PIL import Image

    from neuron_app.engine.trust import marks

    rng = np.random.default_rng(side)
    smooth = rng.integers(40, 216, (side // 16, side // 16, 3), dtype=np.uint8)
    image = Image.fromarray(smooth).resize((side, side), Image.BICUBIC)  # smooth like a picture, not noise

    def save(fmt: str, **options: Any) -> None:
        image.save(io.BytesIO(), format=fmt, **options)

    png = io.BytesIO()
    image.save(png, format="PNG", compress_level=1)
    times = {
        "safety_b1": _timed(lambda: safety.score_batch([image]), repeats),
        "safety_b4": _timed(lambda: safety.score_batch([image] * 4), repeats),
        "watermark": _timed(lambda: marks.embed_watermark(image, marker.payload), repeats),
        "png_6": _timed(lambda: save("PNG", compress_level=6), repeats),
        "png_1": _timed(lambda: save("PNG", compress_level=1), repeats),
        "png_app": _timed(lambda: marks.png_bytes(image, {}), repeats),
        "jpeg_90": _timed(lambda: save("JPEG", quality=90), repeats),
        "webp_90": _timed(lambda: save("WEBP", quality=90), repeats),
        "c2pa": _timed(lambda: marker.signer.sign(png.getvalue(), manifest), repeats),
    }
    row: dict[str, Any] = {"side": side, "holds": marks.embed_watermark(image, marker.payload) is not None}
    row |= {name: t["median_s"] * 1000 for name, t in times.items()}
    row["safety_b4"] /= 4  # per image
    return row


def _queue(manager: Any, shape: str, steps: int, workers: int, safety: bool | str) -> dict[str, Any]:
    """8 requests at once through `request_slots` threads, as Gradio's queue runs them; `safety` "device": the
    classifier's device graph, compiled before the queue (as warm-up does)."""
    from neuron_app.engine.output.postprocess import PostStage, idle_fraction

    manager.post = PostStage(workers)
    manager.safety.enabled = bool(safety)
    manager.safety.on_device = safety == "device"
    manager.safety.prepare_device(manager)
    slots = manager.settings.device_lanes + workers
    seeds = list(range(100, 100 + QUEUE))
    lock = threading.Lock()
    errors: list[str] = []

    def lane_worker() -> None:
        while True:
            with lock:
                if not seeds:
                    return
                seed = seeds.pop(0)
            try:
                manager.generate(PROMPT, shape, steps, seed)
            except Exception as exc:
                errors.append(str(exc))

    first = len(manager._device_lock.holds)
    start = time.perf_counter()
    threads = [threading.Thread(target=lane_worker) for _ in range(slots)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    holds = list(manager._device_lock.holds)[first:]
    idle = idle_fraction(holds)
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(holds)]
    row = {"workers": workers, "safety": safety, "slots": slots, "wall_s": wall, "idle_fraction": idle}
    row |= {"idle_gap_ms": 1000 * sum(gaps) / len(gaps) if gaps else None, "errors": errors}
    return row | {"device_ms": 1000 * sum(e - s for s, e in holds) / len(holds), "throughput": QUEUE / wall}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    import shutil
    import tempfile
    from pathlib import Path

    from neuron_app.settings import load_settings

    folder = Path(tempfile.mkdtemp(prefix="vit-b16-"))
    classifier = "tiny" if spec["smoke"] else _vit_b16(folder)  # the smoke run: the tests' stand-in
    overrides = spec["settings"] | {"safety_checker": "on", "safety_model": classifier, "safety_threads": 1}
    manager = loaded_manager(load_settings(**overrides))
    shape, steps = spec["shape"], spec["steps"]
    manager.compile_shape(shape)
    record = manager.generate(PROMPT, shape, steps, 0)  # the classifier and the signer loaded
    stages = _stages(manager, spec["repeats"], spec["sides"], record)
    runs = [_queue(manager, shape, steps, w, s) for s in (True, False) for w in (2, 0)]
    runs.append(_queue(manager, shape, steps, 2, "device"))  # last: the classifier is then the device's, in bf16
    shutil.rmtree(folder, ignore_errors=True)
    classifier = "the tests' stand-in" if spec["smoke"] else "a ViT-B/16 at 224 px"
    found = {"lane_device": manager.backend.name, "shape": shape, "steps": steps, "stages": stages, "runs": runs}
    return found | {"classifier": classifier}


def section(harness: Any) -> dict[str, Any]:
    cfg = harness.cfg
    shape = "64x64" if cfg.smoke else "256x256"  # 256: the smallest side that carries the watermark
    settings = {"device": "neuron-emulated", "resolutions": [shape], "default_resolution": shape}
    load_start = os.getloadavg()[0]
    sides = [256] if cfg.smoke else list(SIDES)
    result = harness.measure("postprocess", KIND, None, settings, shape=shape, smoke=cfg.smoke, sides=sides)
    # its own command and load: BENCHMARKS.md may show it beside a CPU run made with another command
    result |= {"command": cfg.command, "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    result["load_avg"] = [round(load_start, 2), round(os.getloadavg()[0], 2)]
    by = {(r["safety"], r["workers"]): r for r in result["runs"]}
    for safety in (True, False):
        result[f"throughput_{'on' if safety else 'off'}"] = ratio(
            by[safety, 2]["throughput"], by[safety, 0]["throughput"]
        )
    result["throughput_device"] = ratio(by["device", 2]["throughput"], by[True, 0]["throughput"])
    return result


def _ms(digits: int) -> Any:
    return functools.partial(md.num, digits=digits)


#: The stage table, one column a line: header, key, format (see `md.columns`).
STAGE_COLUMNS = [
    ("image", "side", lambda side: f"{side}x{side}"),
    ("safety b1 ms", "safety_b1", _ms(0)),
    ("safety b4 ms/image", "safety_b4", _ms(0)),
    ("watermark ms", "watermark", _ms(1)),
    ("PNG level 6 (before) ms", "png_6", _ms(1)),
    ("PNG level 1 ms", "png_1", _ms(1)),
    ("PNG, the app's (after) ms", "png_app", _ms(1)),
    ("JPEG q90 ms", "jpeg_90", _ms(1)),
    ("WebP q90 ms", "webp_90", _ms(1)),
    ("C2PA sign ms", "c2pa", _ms(1)),
]
QUEUE_COLUMNS = [
    ("safety", "safety", lambda on: "on, device graph" if on == "device" else "on" if on else "off"),
    ("post stage", "workers", lambda workers: "overlapped (2 post slots)" if workers else "in-line"),
    ("requests at once", "slots"),
    ("lane idle %", "idle_fraction", lambda idle: md.num(100 * (idle or 0), 1)),
    ("idle gap ms", "idle_gap_ms", lambda gap: md.num(gap or 0, 1)),
    ("device ms/request", "device_ms", _ms(0)),
    ("wall s (8 requests)", "wall_s", _ms(2)),
    ("errors", "errors", len),
]


def render(sec: dict[str, Any]) -> str:
    notes = (
        f"\n\nHost milliseconds on one thread (median). Queue: {QUEUE} requests of {sec['shape']}, "
        f"{sec['steps']} steps "
        f"on {sec['lane_device']}, the safety classifier {sec['classifier']} on `safety_threads = 1`. Throughput "
        f"overlapped/in-line: {md.x(sec['throughput_on'])} with safety on, {md.x(sec['throughput_off'])} off (the "
        "floor); the classifier on the device, overlapped, against it on the host in-line: "
        f"{md.x(sec['throughput_device'])}. On two cores the emulated device and the host work share the CPU: the "
        "lane's idle share is the figure that does not depend on it. An overlapped lane that still idles waits for a "
        "post slot (backpressure): the host work per image outlasts the device's. With the classifier on the "
        "device the lane's own work includes it (here CPU time, in bfloat16; on an accelerator milliseconds), "
        "and the host keeps only the marks and the encode."
    )
    if sec.get("command"):
        load = sec.get("load_avg") or ["-", "-"]
        notes += f" Measured with `{sec['command']}` at {sec['measured_at']}, load average {load[0]} to {load[1]}."
    return md.columns(STAGE_COLUMNS, sec["stages"]) + "\n\n" + md.columns(QUEUE_COLUMNS, sec["runs"]) + notes
