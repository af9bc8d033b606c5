"""The selftest's TP check: the guide's TP set-up with the compiled sharded transformer, 2 ranks against 1.

The path the app serves tensor parallelism with (the review's U2: the check used to run the guide's eager snippet),
each rank on a free NeuronCore (U9: not always 0-1, so the selftest can run beside a server on other cores).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from neuron_app.engine.model.vae import psnr

#: TP=2 against TP=1: tiny-shapes on the emulator (a wrong shard: about 18 dB; bf16 rounding of two partial sums:
#: above 40 dB, measured at 64x64), the PSNR the two images must reach.
GUIDE_TP = Path(__file__).resolve().parent.parent.parent / "examples" / "guide_tp_compiled.py"
TP_EMULATED_MODEL, TP_PSNR_DB = Path(__file__).resolve().parent.parent / "models" / "tiny-shapes", 30.0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tp_cores(device: str, ranks: int) -> list[int] | str:
    """The NeuronCores the TP check's ranks take, one each (U9: not always 0..N-1): the first of your
    NEURON_RT_VISIBLE_CORES; else, on the emulator, free ones from its core registry; else 0..N-1. A reason
    (a string) when there are too few."""
    from neuron_app.environment import VISIBLE_CORES_VAR, parse_cores

    theirs = os.environ.get(VISIBLE_CORES_VAR)
    if theirs:
        first, last = parse_cores(theirs)
        if last - first + 1 < ranks:
            return f"TP={ranks} needs {ranks} NeuronCores; {VISIBLE_CORES_VAR}={theirs} gives {last - first + 1}"
        return list(range(first, first + ranks))
    if device != "neuron":
        from neuron_app.backends.emulator import cores

        free = cores.free_cores()
        return free[:ranks] if len(free) >= ranks else f"TP={ranks} needs {ranks} free NeuronCores; free: {free}"
    return list(range(ranks))


def run_ranks(command: list[str], env: dict[str, str], cores: list[int], cwd: Path) -> tuple[int, str, str]:
    """One process per rank with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, the
    rendezvous), each with its own NEURON_RT_VISIBLE_CORES: TorchNeuron keeps a rank's core when the user set it
    (`_set_rt_visible_cores`), which one torchrun cannot give each rank. Each rank's output goes to a file (a full
    pipe would stall a rank inside a collective). (exit code, stdout, stderr) of all ranks together."""
    port, size, procs, logs = str(_free_port()), str(len(cores)), [], []
    for rank, core in enumerate(cores):
        rank_env = env | {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": size, "LOCAL_WORLD_SIZE": size}
        rank_env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NEURON_RT_VISIBLE_CORES": str(core)}
        out, err = cwd / f"rank{rank}-of-{size}.out", cwd / f"rank{rank}-of-{size}.err"
        logs.append((out, err))
        with out.open("w") as stdout, err.open("w") as stderr:
            procs.append(subprocess.Popen(command, cwd=cwd, env=rank_env, stdout=stdout, stderr=stderr, text=True))
    deadline = time.monotonic() + 7200
    while any(proc.poll() is None for proc in procs):  # as torchrun: a failed rank stops the others
        if time.monotonic() > deadline or any(proc.poll() not in (None, 0) for proc in procs):
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            break
        time.sleep(0.5)
    for proc in procs:
        proc.wait(timeout=60)
    code = next((proc.returncode for proc in procs if proc.returncode != 0), 0)
    return code, "".join(o.read_text() for o, _ in logs), "".join(e.read_text() for _, e in logs)


def check_tp(device: str, model: str, cache_dir: Path) -> tuple[str, str]:
    """N4d/N11/U2: the guide's tensor-parallel set-up with the compiled sharded transformer (the path the app
    serves TP with: examples/guide_tp_compiled.py) with 2 ranks against 1, as a user runs it (on the emulator
    under `python -m neuron_app emulate`, with tiny-shapes: the random tiny model's image hardly depends on its
    transformer), on free cores; on the emulator each rank must also hold half of every sharded weight.
    (verdict, what was found) for the selftest's "TP=2 equals TP=1"."""
    if not GUIDE_TP.is_file():
        return "skip", "examples/guide_tp_compiled.py is not here: run the selftest from a checkout"
    emulated = device != "neuron"
    guide = {"GUIDE_MODEL": str(TP_EMULATED_MODEL) if emulated else model, "GUIDE_SIZE": "64" if emulated else "1024"}
    pngs, shares, seconds, used = [], [], [], []
    plan = {ranks: tp_cores(device, ranks) for ranks in (1, 2)}  # free now: the runs are one after the other
    refused = next((why for why in plan.values() if isinstance(why, str)), None)
    if refused is not None:
        return "skip", refused
    for ranks, cores in plan.items():
        assert not isinstance(cores, str)
        out = cache_dir / f"tp-{ranks}.png"
        command = (
            [sys.executable, "-m", "neuron_app", "emulate", str(GUIDE_TP)]
            if emulated
            else [sys.executable, str(GUIDE_TP)]
        )
        env = os.environ | guide | {"GUIDE_OUTPUT": str(out), "TORCH_NEURONX_NEFF_CACHE_DIR": str(cache_dir / "neff")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(GUIDE_TP.parent.parent), env.get("PYTHONPATH")]))
        cache_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        code, stdout, stderr = run_ranks(command, env, cores, cache_dir)
        seconds.append(time.perf_counter() - start)
        if code != 0 or not out.is_file():
            tail = (stderr.strip().splitlines() or ["no output"])[-1][:300]
            return "fail", f"{ranks} rank(s) on core(s) {cores} exited {code}: {tail}"
        compiled = stdout.count("compiled sharded transformer on neuron:")
        if compiled != ranks:
            return "fail", f"{ranks} rank(s): {compiled} said the compiled sharded call ran"
        pngs.append(str(out))
        used.append(cores)
        held = [line for line in stderr.splitlines() if "tensor parallel:" in line]
        shares.append(sorted(line.split("elements, ")[-1].split(")")[0] for line in held))
    value = psnr(pngs[0], pngs[1])
    found = (
        f"compiled sharded transformer, {guide['GUIDE_SIZE']} px, 1 rank {seconds[0]:.0f} s (core {used[0][0]}), "
        f"2 ranks {seconds[1]:.0f} s (cores {used[1][0]}, {used[1][1]}); PSNR {value:.1f} dB"
    )
    sharded = not emulated or shares[1] == ["0.50", "0.50"]
    if emulated:
        found += f"; each rank's share of the sharded weights: {', '.join(shares[1]) or 'none'}"
    return ("pass" if value >= TP_PSNR_DB and sharded else "fail"), found
