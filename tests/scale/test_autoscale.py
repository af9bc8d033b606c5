"""Replicas that follow the queue: replicas = "1-2" on a real local Ray cluster (CPU, tiny model).

Sustained load (three callers) grows 1 replica to 2; a single sequential caller afterwards lets it shrink back to 1;
every request of both phases is answered. The delays are the settings' (kept small here); the time from the start
of the load to the first request served by the second replica is printed (docs/replicas.md quotes it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import TINY_OVERRIDES, link_models, ray_head, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def replica_states() -> dict[str, int]:
    """Ray Serve's own count of the app's replicas by state (STARTING, RUNNING, STOPPING, ...)."""
    from ray import serve

    from neuron_app.scale.serve_app import APP_NAME, DEPLOYMENT_NAME

    app = serve.status().applications.get(APP_NAME)
    return {} if app is None else dict(app.deployments[DEPLOYMENT_NAME].replica_states)


def running_replicas() -> int:
    return replica_states().get("RUNNING", 0)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[str]:
    with ray_head(tmp_path) as address:
        yield address


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
        wait_for(lambda: running_replicas() == 1, 120, "Ray Serve to remove the second replica")
        shrink_s = time.monotonic() - t0
        after = len(served)
        wait_for(lambda: len(served) >= after + 3, 60, "requests after the downscale")
    finally:
        stop.set()
        trickle.join(timeout=120)
    print(f"time to shrink back to 1 replica once the load fell: {shrink_s:.1f} s")
    assert not errors, errors
    assert len(served) > before + 3
    assert not any(t.is_alive() for t in [*callers, trickle])
