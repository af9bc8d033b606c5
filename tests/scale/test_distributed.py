"""Tensor-parallel serving under torchrun with 2 gloo ranks, on CPU.

On `neuron-emulated` the transformer is really sharded (diffusers' TensorParallelConfig over the
emulated device: each rank holds half of every sharded weight) and the two ranks draw one process's
scene. On plain `cpu` diffusers cannot shard, so each rank runs the whole pipeline: there the protocol
is checked bit for bit (rank 0 serves, every call and LoRA style runs on every rank, errors and
shutdown reach every rank), which is the same on Neuron.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from neuron_app.engine.model.shapes_world import judge
from neuron_app.errors import SettingsError
from neuron_app.scale.tp_startup import check_single_process, check_tp_degree, settings_for_world, transformer_heads
from neuron_app.settings import get_settings
from tests.support import PATIENT_HTTP, ROOT, TINY_OVERRIDES, free_port, link_models, pid_alive

PROMPT = "a red circle on a blue background"  # tiny-shapes: the ranks must draw the same scene
SHAPES = ["64x64", "128x64"]
LORAS = {"red": "tiny:1"}  # followers must switch to the style rank 0 sends with each call
START_TIMEOUT_S = 180  # generous: the 2 cores may be shared; an idle machine starts in ~20 s
STOP_TIMEOUT_S = 40  # torchrun itself SIGKILLs its ranks 30 s after forwarding SIGTERM
#: Sharded ranks against one process, both bfloat16 on the emulator: the sums are split and all-reduced, so the
#: rounding differs (a wrong shard or a rank that drew another image: under 20 dB).
SHARDED_PSNR_DB = 30.0


def tp_env(cache_dir: Path, port: int, settings_file: Path, device: str, loras: dict[str, str]) -> dict[str, str]:
    """The tiny model's settings as NEURON_APP_* variables, loopback only."""
    values = TINY_OVERRIDES | {
        "model": "tiny-shapes",
        "device": device,
        "resolutions": SHAPES,
        "cache_dir": str(cache_dir),
        "server_port": port,
        "server_name": "127.0.0.1",
        "loras": loras,
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_APP_")}
    for key, value in values.items():
        env[f"NEURON_APP_{key.upper()}"] = json.dumps(value) if isinstance(value, list | dict) else str(value)
    env |= {
        "NEURON_APP_SETTINGS": str(settings_file),  # an empty file: nothing from the project's settings.toml
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONUNBUFFERED": "1",
        "GRADIO_ANALYTICS_ENABLED": "False",
    }
    return env


def wait_until_serving(proc: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"torchrun exited with {proc.returncode} before serving:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(url + "healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"no server after {START_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")


def rank_lines(log: str, rank: int, needle: str) -> list[str]:
    return [line for line in log.splitlines() if f"[rank {rank}/2]" in line and needle in line]


def start_ranks(tmp_path: Path, shared_models: Path, device: str, loras: dict[str, str]) -> tuple[Any, str, Path]:
    """`torchrun --nproc_per_node=2 app.py` in its own process group: (the launcher, the page's URL, its log)."""
    cache_dir = link_models(tmp_path / "cache", shared_models)
    settings_file = tmp_path / "empty.toml"
    settings_file.write_text("")
    port = free_port()
    log_path = tmp_path / "torchrun.log"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        f"--log-dir={tmp_path / 'torchrun'}",  # torchrun's own folder, else a new /tmp/torchelastic_* each run
        "app.py",
    ]
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=tp_env(cache_dir, port, settings_file, device, loras),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group; its ranks start sessions of their own (see stop_ranks)
        )
    return proc, f"http://127.0.0.1:{port}/", log_path


def rank_pids(log: str) -> dict[int, int]:
    return {int(m.group(1)): int(m.group(2)) for m in re.finditer(r"rank (\d) of 2 started \(pid (\d+)\)", log)}


def stop_ranks(proc: subprocess.Popen[bytes], log_path: Path) -> None:
    """Whatever the test left running: torchrun gets SIGTERM (it forwards it), then SIGKILL; its ranks run in
    sessions of their own, so each one still alive after that is killed by the pid it logged."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for pid in rank_pids(log_path.read_text(errors="replace")).values():
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def single_process(tmp_path: Path, shared_models: Path, device: str, loras: dict[str, str]) -> Any:
    """The single-process reference (same settings, same seed), made while the ranks start. Its own cache folder:
    the emulated NEFF-style artifacts it leaves would make the ranks' compile a disk hit."""
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.settings import load_settings

    single_cache = link_models(tmp_path / "single", shared_models)
    overrides = {"model": "tiny-shapes", "device": device, "resolutions": SHAPES, "cache_dir": single_cache}
    if device == "neuron-emulated":  # the ranks hold cores 0 and 1 (LOCAL_RANK), as on a trn2: this one takes core 2
        os.environ["NEURON_RT_VISIBLE_CORES"] = "2"  # restored after the test (conftest's NEURON_ENV)
    return PipelineManager(load_settings(**(TINY_OVERRIDES | overrides | {"loras": loras})))


@pytest.mark.slow
def test_two_ranks_serve_one_request_in_lockstep_and_stop_on_sigterm(tmp_path: Path, shared_models: Path) -> None:
    """Rank 0 serves; a request runs on both ranks; rank 0's image equals a single process's; SIGTERM stops both."""
    from gradio_client import Client

    proc, url, log_path = start_ranks(tmp_path, shared_models, "cpu", LORAS)
    try:
        single = single_process(tmp_path, shared_models, "cpu", LORAS)
        expected = np.asarray(single.generate(PROMPT, "64x64", 2, 7).image.convert("RGB"))
        styled = np.asarray(single.generate(PROMPT, "64x64", 2, 7, lora="red", lora_scale=0.5).image.convert("RGB"))

        wait_until_serving(proc, url, log_path)
        started = time.monotonic()
        path, info = Client(url, verbose=False, httpx_kwargs=PATIENT_HTTP).predict(
            PROMPT, "64x64", 2, 7, api_name="/generate"
        )
        request_s = time.monotonic() - started
        got = np.asarray(Image.open(path).convert("RGB"))
        assert got.shape == expected.shape == (64, 64, 3)
        assert np.array_equal(got, expected), f"max pixel difference {np.abs(got.astype(int) - expected).max()}"
        assert judge(Image.fromarray(got)) == judge(Image.fromarray(expected))  # the same scene, read back
        assert info["cache"] == "miss" and info["compiled"] is True
        path, info = Client(url, verbose=False, httpx_kwargs=PATIENT_HTTP).predict(
            PROMPT, "64x64", 2, 7, "red", 0.5, api_name="/generate"
        )
        assert info["lora"] == "red" and info["compiled"] is False
        assert np.array_equal(np.asarray(Image.open(path).convert("RGB")), styled)

        ready = httpx.get(url + "readyz", timeout=5)
        assert ready.status_code == 200 and ready.json()["ready_shapes"] == ["64x64"]
        assert ready.json()["ready"] is True

        log = log_path.read_text()
        for rank in (0, 1):  # the compile's warm-up call at the serving step count, then the request itself
            assert rank_lines(log, rank, "executing 64x64 steps=4 seed=0"), log[-4000:]
            assert rank_lines(log, rank, "executing 64x64 steps=2 seed=7"), log[-4000:]
            assert rank_lines(log, rank, "executing 64x64 steps=2 seed=7 lora=red x0.5"), log[-4000:]
        pids = rank_pids(log)
        assert set(pids) == {0, 1}

        stop_started = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # what `docker stop` does to the launcher
        proc.wait(timeout=STOP_TIMEOUT_S)
        stop_s = time.monotonic() - stop_started
        log = log_path.read_text()
        assert rank_lines(log, 0, "told 1 follower(s) to shut down"), log[-4000:]
        assert rank_lines(log, 1, "shutdown from rank 0; exiting"), log[-4000:]
        assert rank_lines(log, 0, "rank 0: stopped"), log[-4000:]
        assert not [pid for pid in pids.values() if pid_alive(pid)]
        print(f"request {request_s:.2f}s, stop {stop_s:.2f}s")
    finally:
        stop_ranks(proc, log_path)


@pytest.mark.slow
def test_two_sharded_ranks_on_neuron_emulated_draw_the_single_process_scene(
    tmp_path: Path, shared_models: Path
) -> None:
    """`torchrun --nproc_per_node=2 app.py` on neuron-emulated shards the transformer (diffusers'
    TensorParallelConfig: each rank holds half of every sharded weight, the rest replicated), compiles it, and
    the page's image is one process's within bfloat16 rounding: the same scene, read back by the judge."""
    from gradio_client import Client

    from neuron_app.engine.model.vae import psnr

    proc, url, log_path = start_ranks(tmp_path, shared_models, "neuron-emulated", {})
    try:
        single = single_process(tmp_path, shared_models, "neuron-emulated", {})
        expected = single.generate(PROMPT, "64x64", 4, 7).image.convert("RGB")
        wait_until_serving(proc, url, log_path)
        path, info = Client(url, verbose=False, httpx_kwargs=PATIENT_HTTP).predict(
            PROMPT, "64x64", 4, 7, api_name="/generate"
        )
        got = Image.open(path).convert("RGB")
        assert info["compiled"] is True, info
        assert psnr(got, expected) >= SHARDED_PSNR_DB, f"{psnr(got, expected):.1f} dB from one process's image"
        assert judge(got) == judge(expected) and judge(got).colour == "red", (judge(got), judge(expected))
        log = log_path.read_text()
        for rank in (0, 1):
            held = rank_lines(log, rank, "transformer sharded:")
            assert held and held[0].endswith("this rank holds 0.50 of their elements"), log[-4000:]
            assert int(held[0].split("sharded: ")[1].split()[0]) > 0, held
        print(f"sharded ranks against one process: {psnr(got, expected):.1f} dB; {held[0].split(': ', 2)[-1]}")
    finally:
        stop_ranks(proc, log_path)


def test_lora_styles_with_a_sharded_transformer_are_refused_before_loading(make_settings: Any) -> None:
    """diffusers adds no adapter to a sharded transformer: the combination is a start-up error naming the fix."""
    from neuron_app.scale.tp_startup import check_loras_unsharded

    check_loras_unsharded(make_settings(loras={"red": "tiny:1"}), None)  # replicated ranks: allowed
    check_loras_unsharded(make_settings(), object())  # sharded, no styles: allowed
    with pytest.raises(SettingsError, match=r"LoRA styles \(red\) cannot be served with tensor parallelism"):
        check_loras_unsharded(make_settings(loras={"red": "tiny:1"}), object())


PROTOCOL_SCRIPT = """
import os, sys, time
from datetime import timedelta
import torch.distributed as dist
from neuron_app.backends import get_backend
from neuron_app.scale.distributed import Lockstep, RankInfo, init_group
from neuron_app.errors import LockstepError
from neuron_app.engine.model.runner import PipelineCall

mode, info = sys.argv[1], RankInfo.from_env()
if mode in ("crash", "error"):
    lockstep = init_group(get_backend("cpu"), info, timeout_s=60)
else:  # a short collective timeout, counted from after the (slower) rendezvous
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    lockstep = Lockstep(info.rank, 2, dist.new_group(backend="gloo", timeout=timedelta(seconds=3)))
call = PipelineCall("x", 64, 64, 1, 0)

if info.rank == 1:
    if mode == "crash":
        lockstep.receive()
        os._exit(3)  # dies in the middle of the call: it never reports its outcome
    if mode == "error":  # fails the first call, succeeds the second, then follows the shutdown
        lockstep.receive()
        lockstep.agree(RuntimeError("out of device memory"))
        lockstep.receive()
        lockstep.agree(None)
        print("RESULT " + repr(lockstep.receive()[0]), flush=True)
        os._exit(0)
    pings, start = 0, time.monotonic()
    try:
        while lockstep.receive()[0] != "shutdown":
            pings += 1
        outcome = "shutdown"
    except Exception as exc:
        outcome = type(exc).__name__
    print("RESULT " + repr((pings, outcome, round(time.monotonic() - start, 1))), flush=True)
    os._exit(0)

if mode == "crash":
    start = time.monotonic()
    lockstep.before(call)
    error = lockstep.after(None)
    seconds = time.monotonic() - start
    try:
        lockstep.before(call)
        again = "accepted"
    except LockstepError as exc:
        again = str(exc)
    print("RESULT " + repr((type(error).__name__, round(seconds, 2), lockstep.broken is not None, again)), flush=True)
elif mode == "error":
    lockstep.before(call)
    first = lockstep.after(None)
    lockstep.before(call)
    second = lockstep.after(None)
    told = lockstep.shutdown(5.0)
    print("RESULT " + repr((str(first), second, lockstep.broken, told)), flush=True)
else:
    if mode == "heartbeat":
        lockstep.start_heartbeat(0.5)
    time.sleep(6)  # idle for twice the follower's 3 s timeout
    print("RESULT " + repr(lockstep.shutdown(1.0)), flush=True)
os._exit(0)
"""


def run_pair(mode: str, timeout_s: float = 60) -> tuple[Any, Any, list[int]]:
    """Rank 0's and rank 1's RESULT tuples and exit codes, from two plain processes joined over gloo."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_APP_")}
    base |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "lo"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PROTOCOL_SCRIPT, mode],
            cwd=ROOT,
            env=base | {"RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [proc.communicate(timeout=timeout_s)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = []
    for output in outputs:
        lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
        results.append(ast.literal_eval(lines[0][len("RESULT ") :]) if lines else output[-3000:])
    return results[0], results[1], [proc.returncode for proc in procs]


@pytest.mark.slow
def test_a_crashed_follower_fails_the_call_on_rank_0_instead_of_hanging() -> None:
    """A follower dying mid-call fails that call on rank 0 promptly, and later calls are refused, not hung."""
    leader, _, codes = run_pair("crash")
    assert codes[1] == 3
    assert isinstance(leader, tuple), leader
    error_type, seconds, broken, again = leader
    assert error_type == "LockstepError" and broken
    assert seconds < 30, f"rank 0 waited {seconds} s (the group timeout is 60 s): the crash was not noticed"
    assert "broken" in again


@pytest.mark.slow
def test_an_error_on_a_follower_is_raised_on_rank_0_and_the_group_goes_on() -> None:
    """Rank 0 succeeded but rank 1 failed: rank 0 raises rank 1's error; the next call and the shutdown still work."""
    leader, follower, codes = run_pair("error")
    assert isinstance(leader, tuple), leader
    first, second, broken, told = leader
    assert first == "rank 1 failed: RuntimeError: out of device memory"
    assert second is None and broken is None and told is True
    assert follower == "shutdown" and codes == [0, 0]


@pytest.mark.slow
@pytest.mark.parametrize("heartbeat", [True, False], ids=["heartbeat", "silent"])
def test_heartbeats_keep_idle_followers_within_the_timeout(heartbeat: bool) -> None:
    """Idle for 6 s against a 3 s collective timeout: with rank 0's pings the follower waits and then gets its
    shutdown; without them it times out (a wedged rank 0 does not hold followers forever)."""
    told, follower, _ = run_pair("heartbeat" if heartbeat else "silent")
    assert isinstance(follower, tuple), follower
    pings, outcome, seconds = follower
    if heartbeat:
        assert told is True and outcome == "shutdown" and pings >= 5
    else:
        assert told is False and outcome == "RuntimeError" and pings == 0 and seconds < 6


def test_tp_degree_must_divide_the_head_count() -> None:
    """24 heads (FLUX.2-klein-4B): 2, 4, 6, 8 work; 5 is refused with the degrees that would."""
    for degree in (1, 2, 4, 6, 8):
        check_tp_degree(degree, 24)
    with pytest.raises(SettingsError, match=r"degree 5 does not divide .* 24 attention heads: use one of 2, 3, 4, 6"):
        check_tp_degree(5, 24)
    check_tp_degree(5, None)  # unknown head count: the load itself will tell


def test_head_count_is_read_from_the_model_config(make_settings: Any) -> None:
    assert transformer_heads(make_settings()) == 2  # the tiny model: 2 heads, so 2 CPU ranks divide it


def test_a_broken_group_is_in_the_status_and_readyz_says_why(make_settings: Any) -> None:
    """Why the manager can no longer serve is status data (`ManagerStatus.broken`), read by /readyz: no probing of
    the manager's lockstep."""
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.scale.distributed import Lockstep
    from neuron_app.web.ops import Ops

    lockstep = Lockstep(0, 2)
    manager = PipelineManager(make_settings(), lockstep=lockstep)
    assert manager.status().broken is None
    lockstep.broken = "rank 1 timed out"
    ops = Ops(manager.settings, manager)
    try:
        ready, body = ops.readiness()
    finally:
        ops.close()
    assert manager.status().broken == "rank 1 timed out" and not ready
    assert body["reason"] == "tensor-parallel group is broken: rank 1 timed out"


def test_tp_degree_comes_from_torchrun(monkeypatch: pytest.MonkeyPatch, make_settings: Any) -> None:
    """Under torchrun tp_degree = WORLD_SIZE (it keys the compile cache); a conflicting setting is refused,
    and tp_degree > 1 without torchrun is refused with the command to use."""
    monkeypatch.setenv("NEURON_APP_TP_DEGREE", "4")
    with pytest.raises(SettingsError, match="torchrun started 2 processes"):
        settings_for_world(2)
    monkeypatch.setenv("NEURON_APP_TP_DEGREE", "1")
    try:
        assert settings_for_world(2).tp_degree == 2
    finally:
        monkeypatch.delenv("NEURON_APP_TP_DEGREE")
        get_settings.cache_clear()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SettingsError, match=r"torchrun --nproc_per_node=2 app.py"):
        check_single_process(make_settings(tp_degree=2))
    check_single_process(make_settings())
