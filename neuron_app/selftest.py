"""`python -m neuron_app selftest`: the review's first device check, one verdict per check.

On a trn instance (TorchNeuron installed) it runs on `neuron`; elsewhere on `neuron-emulated`, the same script
under the emulator's rules, so the day a trn2 is lent the only thing left is to run it there and compare. The
tiny offline model is used (no Hub), in a throw-away cache folder unless `--cache-dir` is given.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SHAPES = ["64x64", "128x64", "64x128"]


@dataclass
class Verdict:
    check: str
    verdict: str  # pass | warn | fail | skip
    found: str

    def line(self) -> str:
        return f"{self.verdict.upper():5} {self.check:24} {self.found}"


def _settings(device: str, cache_dir: Path, **overrides: Any) -> Any:
    from neuron_app.settings import load_settings

    base = {
        "model": "tiny",
        "device": device,
        "resolutions": SHAPES,
        "default_resolution": "64x64",
        "max_sequence_length": 32,
        "max_steps": 8,
        "default_steps": 2,
        "cache_dir": cache_dir,
        "vae_compile": "on",
        "prompt_cache_size": 0,
    }
    if device == "neuron-emulated":
        base["compile_backend"] = "aot_eager"
    return load_settings(**(base | overrides))


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
    return Verdict(
        "in-place probe",
        "warn",
        "allowed here: the emulator's non-contiguous rule is stricter than this TorchNeuron (harmless: the app "
        "no longer writes into device slices)",
    )


def check_tiled_decode(manager: Any) -> tuple[Verdict, float]:
    start = time.perf_counter()
    try:
        record = manager.generate("a lighthouse", "64x64", 2, 1)
    except Exception as exc:
        return Verdict("tiled VAE decode", "fail", str(exc).splitlines()[0][:200]), 0.0
    took = time.perf_counter() - start
    found = (
        f"64x64 in {took:.1f} s with its compile ({record.graphs_compiled} graph(s), {record.eager_compiles} eager "
        f"op(s)); VAE graphs {manager.status().vae_compiles}"
    )
    return Verdict("tiled VAE decode", "pass", found), took


def check_tile_compile(manager: Any) -> Verdict:
    """Time one VAE tile graph compile on its own, then the same tile warm."""
    import torch

    from neuron_app.engine.compile.compiler import CountingBackend
    from neuron_app.engine.model.vae import TiledDecoder, TileSpec, vae_backend

    spec = TileSpec(manager.settings.vae_tile, manager.settings.vae_tile_overlap)
    counter = CountingBackend(vae_backend(manager.compile_backend), check=manager.backend.check_graph)
    decoder = TiledDecoder(manager.pipe.vae, spec, counter)
    decoder._tile_fn = manager.backend.wrap_graph(decoder._tile_fn, "vae_tile")
    channels = manager.pipe.vae.config.latent_channels
    z = torch.zeros(1, channels, spec.tile, spec.tile, dtype=getattr(torch, manager.dtype_name))
    times = []
    for _ in range(2):
        start = time.perf_counter()
        with manager.backend.device_work():
            decoder.decode(z.to("neuron"), return_dict=False)
            manager.backend.synchronize()
        times.append(time.perf_counter() - start)
    return Verdict("VAE tile compile", "pass", f"first tile {times[0]:.2f} s (compile), warm {times[1]:.3f} s")


def check_sibling(manager: Any) -> Verdict:
    """Review S2: a sibling of a token family shares the transformer graph but meets its own eager glue."""
    manager.generate("wide", "128x64", 2, 1)
    start = time.perf_counter()
    first = manager.generate("tall", "64x128", 2, 1)
    took = time.perf_counter() - start
    again = manager.generate("tall again", "64x128", 2, 2)
    found = (
        f"64x128 after 128x64: {first.graphs_compiled} graph(s), {first.eager_compiles} eager compile(s), "
        f"{took:.2f} s; next request {again.graphs_compiled} graph(s), {again.eager_compiles} eager"
    )
    ok = again.graphs_compiled == 0 and again.eager_compiles == 0
    return Verdict("sibling shape", "pass" if ok else "fail", found)


def check_fallbacks(manager: Any) -> Verdict:
    ops = manager.backend.fallback_ops()
    if not ops:
        return Verdict("fallback ops", "pass", "nothing ran on the CPU (get_fallback_ops() empty)")
    return Verdict("fallback ops", "warn", f"{len(ops)} op(s) ran on the CPU: {', '.join(ops[:8])}")


def check_warm_load(settings: Any) -> Verdict:
    """A new manager on the same cache folder: the first request loads graphs from the warm cache."""
    from neuron_app.engine.manager import PipelineManager

    manager = PipelineManager(settings)
    manager.ensure_loaded()
    start = time.perf_counter()
    record = manager.generate("after a restart", "64x64", 2, 3)
    took = time.perf_counter() - start
    ok = record.cache.value in ("disk", "memory") and record.eager_compiles == 0
    found = f"first request {took:.2f} s, cache {record.cache.value}, {record.eager_compiles} eager compile(s)"
    return Verdict("warm-cache graph load", "pass" if ok else "fail", found)


def check_nki_sdpa(device: str, cache_dir: Path) -> Verdict:
    """Review M11: the same image with the NKI SDPA kernel on and off (a process each: read at import)."""
    if device != "neuron":
        return Verdict("NKI SDPA on/off", "skip", "no NKI kernels on the emulator; run on a trn instance")
    pixels = []
    for flag in ("0", "1"):
        out = cache_dir / f"sdpa-{flag}.png"
        env = {"TORCH_NEURONX_ENABLE_NKI_SDPA": flag}
        cmd = [sys.executable, "-m", "neuron_app.selftest", "--image", str(out), "--cache-dir", str(cache_dir / flag)]
        done = subprocess.run(cmd, env={**__import__("os").environ, **env}, capture_output=True, text=True)
        if done.returncode != 0:
            return Verdict("NKI SDPA on/off", "fail", f"SDPA={flag}: {done.stderr.strip().splitlines()[-1:]}")
        pixels.append(out)
    from PIL import Image, ImageChops

    a, b = (Image.open(p).convert("RGB") for p in pixels)
    diff = max(ImageChops.difference(a, b).getextrema(), key=lambda e: e[1])[1]
    return Verdict("NKI SDPA on/off", "pass" if diff <= 8 else "warn", f"largest pixel difference {diff}/255")


def check_tp(device: str) -> Verdict:
    if device != "neuron":
        why = "diffusers' TP needs a neuron device; tests/scale/test_distributed.py"
        return Verdict("TP=2 equals TP=1", "skip", why)
    return Verdict(
        "TP=2 equals TP=1",
        "skip",
        "run: torchrun --nproc_per_node=2 app.py with NEURON_APP_MODEL=tiny and compare /generate with a "
        "single-process image of the same seed (docs/verified.md)",
    )


def run(device: str, cache_dir: Path) -> list[Verdict]:
    from neuron_app.environment import prepare_process

    settings = _settings(device, cache_dir)
    prepare_process(settings)
    from neuron_app.engine.manager import PipelineManager

    manager = PipelineManager(settings)
    manager.ensure_loaded()
    verdicts = [check_in_place(manager)]
    decode, _ = check_tiled_decode(manager)
    verdicts += [decode, check_tile_compile(manager), check_sibling(manager), check_fallbacks(manager)]
    verdicts += [check_warm_load(settings), check_nki_sdpa(device, cache_dir), check_tp(device)]
    return verdicts


def _image(out: Path, cache_dir: Path) -> int:
    """One 64x64 image on neuron for the SDPA comparison (a subprocess of `check_nki_sdpa`)."""
    settings = _settings("neuron", cache_dir)
    from neuron_app.environment import prepare_process

    prepare_process(settings)
    from neuron_app.engine.manager import PipelineManager

    PipelineManager(settings).generate("nki sdpa", "64x64", 2, 11).image.save(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m neuron_app selftest", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "neuron", "neuron-emulated"], default="auto")
    parser.add_argument("--cache-dir", type=Path, help="default: a throw-away folder")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--image", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.image:
        return _image(args.image, args.cache_dir)
    device = args.device
    if device == "auto":
        from neuron_app.backends.neuron import NeuronBackend

        device = "neuron" if NeuronBackend().is_available() else "neuron-emulated"
    with tempfile.TemporaryDirectory(prefix="neuron-selftest-") as tmp:
        cache_dir = args.cache_dir or Path(tmp)
        verdicts = run(device, cache_dir)
    if args.json:
        print(json.dumps({"device": device, "checks": [asdict(v) for v in verdicts]}, indent=2))
    else:
        print(f"selftest on {device}")
        for v in verdicts:
            print(v.line())
    failed = [v for v in verdicts if v.verdict == "fail"]
    if not args.json:
        print(f"selftest: {len(verdicts)} checks, {len(failed)} failing")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
