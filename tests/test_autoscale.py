"""Replicas that follow the queue: replicas = "1-2" on a real local Ray cluster (CPU, tiny model).

Sustained load (three callers) grows 1 replica to 2; a single sequential caller afterwards lets it shrink back to 1;
every request of both phases is answered. The delays are the settings' (kept small here); the time from the start
of the load to the first request served by the second replica is printed (docs/replicas.md quotes it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import TINY_OVERRIDES, free_port, link_models

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def _wait(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def replica_states() -> dict[str, int]:
    """Ray Serve's own count of the app's replicas by state (STARTING, RUNNING, STOPPING, ...)."""
    from ray import serve

    from neuron_app.scale.replicas import APP_NAME, DEPLOYMENT_NAME

    app = serve.status().applications.get(APP_NAME)
    return {} if app is None else dict(app.deployments[DEPLOYMENT_NAME].replica_states)


def running_replicas() -> int:
    return replica_states().get("RUNNING", 0)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[str]:
    """`ray start --head --block` with 2 CPUs on free ports (as tests/test_replicas.py), ended by its own pid."""
    port = free_port()
    log = (tmp_path / "ray-start.log").open("wb")
    ports = [f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}"]
    command = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", f"--port={port}", *ports]
    command += ["--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats"]
    env = os.environ | {"RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    started = lambda: b"Ray runtime started" in (tmp_path / "ray-start.log").read_bytes()  # noqa: E731
    _wait(lambda: started() or proc.poll() is not None, 180, "ray start --head")  # a loaded machine is slow
    assert proc.poll() is None, (tmp_path / "ray-start.log").read_text()
    yield f"127.0.0.1:{port}"
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    log.close()


@pytest.fixture
def scaling(cluster: str, tmp_path: Path, shared_models: Path) -> Iterator[Any]:
    from neuron_app.scale.replicas import start_replicas
    from neuron_app.settings import load_settings

    cache = link_models(tmp_path / "cache", shared_models)
    scale = {"replicas": "1-2", "autoscale_upscale_delay_s": 2.0, "autoscale_downscale_delay_s": 5.0}
    base = {"cache_dir": cache, "resolutions": ["64x64"], "ray_address": cluster}
    settings = load_settings(**(TINY_OVERRIDES | base | scale))
    assert (settings.replicas_min, settings.replicas_max, settings.device_lanes) == (1, 2, 2)
    client = start_replicas(settings)
    yield client
    client.close()


def test_one_replica_grows_to_two_under_load_and_shrinks_back_with_no_request_lost(scaling: Any) -> None:
    client = scaling
    assert running_replicas() == 1
    client.generate("warm", "64x64", 2, 0)  # the first replica compiles the shape
    served: list[tuple[float, str]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def caller(seed: int) -> None:
        while not stop.is_set():
            try:
                record = client.generate("load", "64x64", 8, seed)
            except BaseException as exc:
                errors.append(exc)
                return
            served.append((time.monotonic(), record.replica or ""))
            seed += 10

    start = time.monotonic()
    first = served_by_first = decided = None
    callers = [threading.Thread(target=caller, args=(i,)) for i in range(3)]
    for thread in callers:
        thread.start()
    try:
        deadline = start + 180
        while time.monotonic() < deadline and not errors:
            ids = {rid for _t, rid in served}
            if len(ids) >= 2:
                break
            if decided is None and sum(replica_states().values()) >= 2:
                decided = time.monotonic()  # Serve chose to add a replica (it starts: loads the model)
            time.sleep(0.2)
        ids = list(dict.fromkeys(rid for _t, rid in served))
        assert len(ids) >= 2 and not errors, (ids, errors, len(served))
        served_by_first = ids[0]
        first = next(t for t, rid in served if rid != served_by_first)
        assert running_replicas() == 2
    finally:
        stop.set()
        for thread in callers:
            thread.join(timeout=120)
    grow_s = first - start
    decided_s = (decided or first) - start
    print(f"\ntime to the second replica serving: {grow_s:.1f} s (added after {decided_s:.1f} s)", len(served))

    # One caller at a time: about 1 request in flight, the target of one replica; Serve removes the other.
    stop.clear()
    before = len(served)
    trickle = threading.Thread(target=caller, args=(1000,))
    trickle.start()
    try:
        t0 = time.monotonic()
        _wait(lambda: running_replicas() == 1, 120, "Ray Serve to remove the second replica")
        shrink_s = time.monotonic() - t0
        after = len(served)
        _wait(lambda: len(served) >= after + 3, 60, "requests after the downscale")
    finally:
        stop.set()
        trickle.join(timeout=120)
    print(f"time to shrink back to 1 replica once the load fell: {shrink_s:.1f} s")
    assert not errors, errors
    assert len(served) > before + 3
    assert not any(t.is_alive() for t in [*callers, trickle])
