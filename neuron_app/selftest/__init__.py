"""`python -m neuron_app selftest`: the second review's "First device check", one verdict per check.

On a trn2, each check failing where the device would: the real model (`--model`, klein-4B by default) at 1024x1024
and a 4032-token shape at the serving step count (compile seconds, device memory, NKI attention as measured, the
shape's own CPU fallbacks); VAE tiles of 256, 384 and 512 px, each compiled in a fresh cache in its own process, with
the PSNR against `vae_device=cpu`; the restart in a second process on the same cache; image-to-image, inpaint, an
edit and a LoRA switch (`--lora NAME=SOURCE` twice) at a ready shape meeting 0 compiles; NKI SDPA on against off;
TP=2 against TP=1 (examples/guide_tp_compiled.py: the compiled sharded transformer, ranks on free cores); two cores
in one process (whether a direct core-to-core copy works, which device a compiled graph runs on). Every
other check runs in a process of its own, one at a time, on one NeuronCore; this process never opens the device (T1,
T2). Elsewhere it runs on `neuron-emulated` with the tiny
model (the NKI gate is then a prediction from the traced graph: 480 text tokens make 128x64 qualify, 64x64 not).
It prints a verdict per check and writes a JSON report (`--report`) to attach to an issue.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from neuron_app.engine.model.vae import psnr
from neuron_app.selftest.checks import Verdict, device_checks

SHAPES = ["64x64", "128x64", "64x128"]
#: The device profile: klein-4B at 1024x1024 (4608 joint tokens) and a 4032-token shape (4544: no NKI kernel).
DEVICE_MODEL, DEVICE_SHAPES, DEVICE_TILES = (
    "black-forest-labs/FLUX.2-klein-4B",
    ["1024x1024", "1152x896"],
    [256, 384, 512],
)
#: On the emulator: the tiny model, 480 text tokens (128x64: 32 + 480 = 512, the kernel; 64x64: 496, not).
EMULATED_SHAPES, EMULATED_TILES, EMULATED_TEXT = ["128x64", "64x64"], [256, 384, 512], 480
#: The LoRA switch with the tiny model: two random adapters of ranks 4 and 8 (slots padded to the larger).
TINY_LORAS = {"selftest-a": "tiny:1", "selftest-b": "tiny:2"}


def _settings(device: str, cache_dir: Path, **overrides: Any) -> Any:
    from neuron_app.settings import load_settings

    shapes = overrides.pop("shapes", SHAPES)
    tiny = overrides.get("model", "tiny") == "tiny"
    base = {"model": "tiny", "device": device, "resolutions": shapes, "default_resolution": shapes[0]}
    base |= {"max_sequence_length": 32 if tiny else 512, "max_steps": 8, "default_steps": 2 if tiny else 4}
    base |= {"cache_dir": cache_dir, "vae_compile": "on", "prompt_cache_size": 0}
    if device == "neuron-emulated":
        base["compile_backend"] = "aot_eager"
    return load_settings(**(base | overrides))


def check_core() -> str:
    """The one NeuronCore every check's process takes (the first of your NEURON_RT_VISIBLE_CORES, else 0): the
    checks run one at a time and this process never opens the device, so none finds its core held (T1)."""
    from neuron_app.environment import VISIBLE_CORES_VAR, parse_cores

    theirs = os.environ.get(VISIBLE_CORES_VAR)
    return str(parse_cores(theirs)[0]) if theirs else "0"


def worker(args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """This module in a fresh process (`--worker ...`) on one NeuronCore: its last line is a JSON result."""
    from neuron_app.environment import VISIBLE_CORES_VAR

    cmd = [sys.executable, "-m", "neuron_app.selftest", "--worker", *args]
    env = {**os.environ, VISIBLE_CORES_VAR: check_core(), **(env or {})}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=7200)
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode != 0 or not lines:
        errors = [x for x in done.stderr.splitlines() if x.strip()]
        return {"error": (errors[-1] if errors else f"exit code {done.returncode}")[:300]}
    return json.loads(lines[-1])


def check_on_device(device: str, model: str, cache_dir: Path, loras: dict[str, str]) -> list[Verdict]:
    """`device_checks` in a process of its own, which exits (freeing its core) before the next check starts."""
    got = worker(["checks", device, model, "-", str(cache_dir)], {"NEURON_APP_LORAS": json.dumps(loras)})
    if "error" in got:
        return [Verdict("device checks", "fail", got["error"])]
    return [Verdict(**v) for v in got["verdicts"]]


def check_restart(device: str, model: str, shape: str, cache_dir: Path, loras: dict[str, str]) -> Verdict:
    """N4c/N7: a second process on the same cache (and the same LoRA slots, which are part of the graph): its first
    request loads the graphs from disk, compiles none."""
    got = worker(["restart", device, model, shape, str(cache_dir)], {"NEURON_APP_LORAS": json.dumps(loras)})
    if "error" in got:
        return Verdict("restart (2nd process)", "fail", got["error"])
    ok = got["cache"] in ("disk", "memory") and got["eager"] == 0 and got["graphs_missed"] == 0
    found = f"first request {got['seconds']:.2f} s, cache {got['cache']}, {got['eager']} eager compile(s)"
    return Verdict("restart (2nd process)", "pass" if ok else "fail", found)


def check_tiles(device: str, model: str, tiles: list[int], cache_dir: Path) -> list[Verdict]:
    """N5: each tile size compiled in a fresh cache in its own process; PSNR against vae_device=cpu, decoded in a
    process of its own (T2: never a second pipeline beside the first on one core), once per image side."""
    verdicts: list[Verdict] = []
    hosts: dict[int, dict[str, Any]] = {}
    for tile in tiles:
        side = max(512, tile)
        if side not in hosts:
            hosts[side] = worker(["host", device, model, str(side), str(cache_dir / f"tile-host-{side}")])
        got = hosts[side]
        if "error" not in got:
            got = worker(["tile", device, model, str(tile), str(cache_dir / f"tile-{tile}")])
        if "error" in got:
            verdicts.append(Verdict(f"VAE tile {tile} px", "fail", got["error"]))
            continue
        value = psnr(got["png"], hosts[side]["png"])
        found = f"first decode {got['seconds']:.1f} s (fresh cache), PSNR {value:.1f} dB against vae_device=cpu"
        verdicts.append(Verdict(f"VAE tile {tile} px", "pass" if value >= 30 else "warn", found))
    return verdicts


def check_nki_sdpa(device: str, model: str, shape: str, cache_dir: Path) -> Verdict:
    """N1/M11: the same image with TORCH_NEURONX_ENABLE_NKI_SDPA=0 and =1 at a shape the gate lets through."""
    if device != "neuron":
        return Verdict("NKI SDPA on/off", "skip", "no NKI kernels on the emulator; the gate is in the profile lines")
    got = [
        worker(
            ["image", device, model, shape, str(cache_dir / f"sdpa-{flag}")], {"TORCH_NEURONX_ENABLE_NKI_SDPA": flag}
        )
        for flag in ("0", "1")
    ]
    if any("error" in g for g in got):
        return Verdict("NKI SDPA on/off", "fail", next(g["error"] for g in got if "error" in g))
    found = f"{shape}: {got[0]['seconds']:.2f} s a request decomposed, {got[1]['seconds']:.2f} s with the kernel"
    return Verdict("NKI SDPA on/off", "pass", found + f"; PSNR {psnr(got[0]['png'], got[1]['png']):.1f} dB")


CORE_CHECKS = ("core-to-core copy", "compiled graph runs on")


def check_cores(device: str, cache_dir: Path) -> list[Verdict]:
    """Two NeuronCores in one process (`backends/core_probe.py`, well under a minute): whether a direct core-to-core
    copy works and which device a compiled graph runs on, one line each; on the emulator, its rules."""
    from neuron_app.scale.tp_check import tp_cores

    pair = tp_cores(device, 2)
    names = CORE_CHECKS
    if isinstance(pair, str) or pair[1] != pair[0] + 1:
        why = pair if isinstance(pair, str) else f"no two neighbouring free cores ({pair})"
        return [Verdict(name, "skip", why) for name in names]
    from neuron_app.environment import FALLBACK_VARS, VISIBLE_CORES_VAR

    probe = ["-m", "neuron_app.backends.core_probe"]
    cmd = [sys.executable, *(probe if device == "neuron" else ["-m", "neuron_app", "emulate", *probe])]
    env = os.environ | FALLBACK_VARS | {VISIBLE_CORES_VAR: f"{pair[0]}-{pair[1]}"}
    env["TORCH_NEURONX_NEFF_CACHE_DIR"] = str(cache_dir / "core-probe")
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return [Verdict(name, "fail", "the probe took more than 600 s") for name in names]
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = ([x for x in done.stderr.splitlines() if x.strip()] or [f"exit code {done.returncode}"])[-1][:300]
        return [Verdict(name, "fail", tail) for name in names]
    got = json.loads(lines[-1])
    return [Verdict(names[0], "pass", got["copy"]), Verdict(names[1], "pass", got["graph"])]


def check_tp(device: str, model: str, cache_dir: Path) -> Verdict:
    """The compiled sharded transformer, 2 ranks against 1, on free cores (`scale/tp_check.py`)."""
    from neuron_app.scale.tp_check import check_tp as run_check

    return Verdict("TP=2 equals TP=1", *run_check(device, model, cache_dir))


#: Checks `--skip` can leave out (one already run on its own, e.g. `scale/tp_check.py` by its own test).
SKIPPABLE = ("tp", "cores")


def run(
    device: str, model: str, cache_dir: Path, loras: dict[str, str] | None = None, skip: tuple[str, ...] = ()
) -> list[Verdict]:
    """Every check in a process of its own, one at a time, each on one NeuronCore (`check_core`); this process never
    opens the device (T1: the runtime gives a core to one process until it exits, so a check started beside a
    parent that held the cores could not start), and no process holds two pipelines (T2)."""
    emulated = device != "neuron"
    shapes, tiles = (EMULATED_SHAPES, EMULATED_TILES) if emulated else (DEVICE_SHAPES, DEVICE_TILES)
    if loras is None and model == "tiny":
        loras = TINY_LORAS
    loras = loras or {}
    verdicts = check_on_device(device, model, cache_dir / "main", loras)
    verdicts.append(check_restart(device, model, shapes[0], cache_dir / "main", loras))
    verdicts += check_tiles(device, model, tiles, cache_dir)
    verdicts.append(check_nki_sdpa(device, model, shapes[0], cache_dir))
    if "tp" in skip:
        verdicts.append(Verdict("TP=2 equals TP=1", "skip", "skipped (--skip tp)"))
    else:
        verdicts.append(check_tp(device, model, cache_dir / "tp"))
    if "cores" in skip:
        return verdicts + [Verdict(name, "skip", "skipped (--skip cores)") for name in CORE_CHECKS]
    return verdicts + check_cores(device, cache_dir)


def run_worker(job: str, device: str, model: str, arg: str, cache: str) -> int:
    """One job in this fresh process; prints its JSON result as the last line."""
    from neuron_app.environment import prepare_process

    cache_dir = Path(cache)
    extra = {"max_sequence_length": EMULATED_TEXT} if device != "neuron" and model == "tiny" else {}
    shapes = EMULATED_SHAPES if device != "neuron" else DEVICE_SHAPES
    if job == "checks":
        settings = _settings(device, cache_dir, model=model, shapes=shapes, **extra)
    elif job in ("tile", "host"):  # a tile size on the device, or the same image decoded on the host
        side = max(512, int(arg))
        shapes = [f"{side}x{side}"]
        decode = {"vae_tile": int(arg) // 8} if job == "tile" else {"vae_device": "cpu"}
        settings = _settings(device, cache_dir, model=model, shapes=shapes, **decode)
    else:
        shapes = [arg]
        settings = _settings(device, cache_dir, model=model, shapes=shapes, **extra)
    prepare_process(settings)
    from neuron_app.engine.manager import PipelineManager

    manager = PipelineManager(settings)
    manager.ensure_loaded()
    if job == "checks":
        print(json.dumps({"verdicts": [asdict(v) for v in device_checks(manager, shapes)]}))
        return 0
    start = time.perf_counter()
    record = manager.generate("a lighthouse at dusk", shapes[0], settings.default_steps, 7)
    result: dict[str, Any] = {"seconds": time.perf_counter() - start, "cache": record.cache.value}
    result |= {"eager": record.eager_compiles, "graphs_missed": int(record.cache.value == "miss")}
    out = cache_dir / "image.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    record.image.save(out)
    result["png"] = str(out)
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m neuron_app selftest", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "neuron", "neuron-emulated"], default="auto")
    parser.add_argument("--model", help=f"default: {DEVICE_MODEL} on neuron, the tiny model on neuron-emulated")
    parser.add_argument("--cache-dir", type=Path, help="default: a throw-away folder")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--report", type=Path, help="also write the JSON report here (attach it to an issue)")
    parser.add_argument(
        "--lora",
        action="append",
        default=None,
        metavar="NAME=SOURCE",
        help="a LoRA style for the switch check (twice: a .safetensors path or a Hub id each); tiny ones by default",
    )
    parser.add_argument(
        "--skip", action="append", default=[], choices=SKIPPABLE, help="leave a check out (its verdict says skip)"
    )
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return run_worker(*args.worker)
    device = args.device
    if device == "auto":
        from neuron_app.backends.neuron import NeuronBackend

        device = "neuron" if NeuronBackend().is_available() else "neuron-emulated"
    model = args.model or (DEVICE_MODEL if device == "neuron" else "tiny")
    with tempfile.TemporaryDirectory(prefix="neuron-selftest-") as tmp:
        cache_dir = args.cache_dir or Path(tmp)
        loras = dict(item.split("=", 1) for item in args.lora) if args.lora else None
        verdicts = run(device, model, cache_dir, loras, tuple(args.skip))
    failed = [v for v in verdicts if v.verdict == "fail"]
    report = {"device": device, "model": model, "failed": len(failed), "checks": [asdict(v) for v in verdicts]}
    if args.report:
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"selftest on {device} with {model}")
        for v in verdicts:
            print(v.line())
        print(f"selftest: {len(verdicts)} checks, {len(failed)} failing")
    return 1 if failed else 0
