"""The selftest's checks on one loaded manager, run in the `checks` worker's process (`--worker checks ...`):
the in-place probe, each shape's profile, image-to-image and inpaint, an edit and a LoRA switch at a ready shape."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from neuron_app.backends.nki_gate import nki_verdict


@dataclass
class Verdict:
    check: str
    verdict: str  # pass | warn | fail | skip
    found: str

    def line(self) -> str:
        return f"{self.verdict.upper():5} {self.check:24} {self.found}"


def check_in_place(manager: Any) -> Verdict:
    """Review B2: an in-place add into a strided slice of a device tensor (what the old tile blend did)."""
    import torch

    device = "neuron"
    try:
        with manager.backend.device_work():
            t = torch.zeros(1, 3, 64, 64, device=device)
            t[:, :, 8:40, 8:40] += 1
            manager.backend.synchronize()
    except Exception as exc:
        return Verdict("in-place probe", "pass", f"refused as modelled: {str(exc).splitlines()[0][:160]}")
    why = "the emulator's non-contiguous rule is stricter than this TorchNeuron (harmless: the app no longer writes"
    return Verdict("in-place probe", "warn", f"allowed here: {why} into device slices)")


def device_memory() -> str:
    import torch

    module = getattr(torch, "neuron", None)
    for name in ("memory_allocated", "max_memory_allocated"):
        if hasattr(module, name):
            try:
                return f"{getattr(module, name)() / 2**30:.2f} GiB ({name})"
            except Exception:
                continue
    return "not reported by torch.neuron"


def check_profile(manager: Any, shapes: list[str]) -> list[Verdict]:
    """Each shape at the serving step count: compile seconds, memory, NKI attention, its own CPU fallbacks."""
    verdicts = []
    for shape in shapes:
        start, failures_before = time.perf_counter(), manager.backend.nki_kernel_failures()  # None: emulated
        try:
            manager.compile_shape(shape)
        except Exception as exc:
            verdicts.append(Verdict(f"profile {shape}", "fail", str(exc).splitlines()[0][:200]))
            continue
        took = time.perf_counter() - start
        row = manager.status().shapes[shape]
        nki, degraded = nki_verdict(row.nki_attention, failures_before, manager.backend.nki_kernel_failures())
        glue = ", ".join(row.fallback_ops) or "none"
        found = (
            f"compile {took:.1f} s, {row.graphs} graph(s), {row.eager_compiles} eager; memory {device_memory()}; "
            f"NKI attention {nki}; CPU fallbacks {glue}"
        )
        verdicts.append(Verdict(f"profile {shape}", "warn" if row.degraded or degraded else "pass", found))
    return verdicts


def check_sources_at_ready_shape(manager: Any, shape: str) -> Verdict:
    """N10: image-to-image and inpaint at a ready shape meet 0 compiles (the warm-up ran an inpaint there)."""
    from PIL import Image, ImageDraw

    res = manager.configured_resolution(shape)
    source = Image.new("RGB", (res.width, res.height), (90, 140, 200))
    mask = Image.new("L", source.size, 0)
    ImageDraw.Draw(mask).rectangle((0, 0, res.width // 2, res.height), fill=255)
    records = [
        manager.generate("selftest", shape, manager.settings.default_steps, 5, image=source, mask=mask),
        manager.generate("selftest", shape, manager.settings.default_steps, 5, image=source, strength=0.6),
    ]
    compiled = [r.graphs_compiled + r.eager_compiles for r in records]
    found = f"inpaint {compiled[0]} compile(s), image-to-image {compiled[1]} compile(s) at {shape}"
    return Verdict("img2img/inpaint ready", "pass" if not any(compiled) else "fail", found)


def check_edit_ready(manager: Any, shape: str) -> Verdict:
    """N4e: an edit whose graph was compiled ahead (as `precompile --references 1` does) meets 0 compiles."""
    from PIL import Image

    res = manager.configured_resolution(shape)
    reference = Image.new("RGB", (res.width, res.height), (200, 40, 40))
    try:
        manager.compile_shape(shape, references=[shape])  # the bucket a reference of the same size snaps to
        record = manager.generate("make it blue", shape, manager.settings.default_steps, 5, references=[reference])
    except Exception as exc:
        return Verdict("edit ready", "fail", str(exc).splitlines()[0][:200])
    compiles = record.graphs_compiled + record.eager_compiles
    found = f"1 reference at {shape}: {record.graphs_compiled} graph(s), {record.eager_compiles} eager compile(s)"
    return Verdict("edit ready", "pass" if compiles == 0 else "fail", found)


def check_lora_switch(manager: Any, shape: str) -> Verdict:
    """N4e: switching LoRA styles at a ready shape (one style, the other, none) meets 0 compiles: the adapters
    live in slots compiled into the graph, so a switch only copies weights."""
    names = list(manager.settings.loras)
    if len(names) < 2:
        return Verdict("LoRA switch", "skip", "give two styles (--lora NAME=SOURCE, twice) to switch between")
    steps = manager.settings.default_steps
    try:
        manager.generate("a fox", shape, steps, 3, lora=names[0])  # the first load of a style may compile
        records = [manager.generate("a fox", shape, steps, 3, lora=name) for name in (names[1], names[0], "none")]
    except Exception as exc:
        return Verdict("LoRA switch", "fail", str(exc).splitlines()[0][:200])
    counts = [r.graphs_compiled + r.eager_compiles for r in records]
    found = f"{names[1]}, {names[0]}, none at {shape}: {', '.join(map(str, counts))} compile(s)"
    return Verdict("LoRA switch", "pass" if not any(counts) else "fail", found)


def device_checks(manager: Any, shapes: list[str]) -> list[Verdict]:
    """The checks on one loaded manager, in the `checks` worker's process: in-place probe, the profile of each
    shape, image-to-image and inpaint at a ready shape, an edit and a LoRA switch."""
    verdicts = [check_in_place(manager), *check_profile(manager, shapes)]
    verdicts.append(check_sources_at_ready_shape(manager, shapes[0]))
    return [*verdicts, check_edit_ready(manager, shapes[0]), check_lora_switch(manager, shapes[0])]
