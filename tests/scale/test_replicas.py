"""Many replicas on Ray Serve (CPU, tiny model, a real local Ray).

One `ray start --head` cluster per module (one CPU per replica), joined through `ray_address` as a multi-instance
deployment would; `python app.py` with `replicas=2` starts (and stops) its own Ray instance.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT, TEST_SHAPES, TINY_OVERRIDES, AppProcess, link_models, pid_alive, ray_head, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_one_replica_never_imports_ray(tmp_path: Path, shared_models: Path) -> None:
    """The default path (replicas = 1, no ray_address) is today's in-process manager, and Ray stays unloaded."""
    cache = link_models(tmp_path / "cache", shared_models)
    code = (
        "import json, os, sys; from neuron_app.settings import load_settings; "
        "from neuron_app.scale import make_manager; "
        "m = make_manager(load_settings(**json.loads(os.environ['TEST_OVERRIDES']))); "
        "print(type(m).__name__, 'ray' in sys.modules)"
    )
    env = os.environ | {"TEST_OVERRIDES": json.dumps(TINY_OVERRIDES | {"cache_dir": str(cache)})}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["PipelineManager", "False"]


#: A local Ray start whose first try runs out of Ray's 30 s for real: the raylet's registration is hidden from the
#: first try (Ray's `services.get_node`, which node.py polls, fails for it), then seen. Prints the processes below
#: this one at each try's start and after the instance is up.
SLOW_FIRST_START = """
import logging, sys
import psutil, ray
import ray._private.services as services
from neuron_app.scale.local_ray import init_local

logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(name)s: %(message)s")
real_get_node, real_init, tries = services.get_node, ray.init, []

def get_node(*args, **kwargs):
    if len(tries) == 1:
        raise RuntimeError("held back by the test: the raylet has not registered")
    return real_get_node(*args, **kwargs)

def init(*args, **kwargs):
    tries.append(len(psutil.Process().children(recursive=True)))
    return real_init(*args, **kwargs)

services.get_node, ray.init = get_node, init
init_local(ray, num_cpus=1, include_dashboard=False, logging_level="WARNING")
print("RESULT", tries, ray.cluster_resources().get("CPU"), flush=True)
ray.shutdown()
"""


def test_a_local_ray_start_that_runs_out_of_rays_30_s_is_made_again_and_leaves_nothing(tmp_path: Path) -> None:
    """Two suites side by side: `python app.py` with replicas failed at start with Ray's "The current node timed
    out during startup" (its fixed 30 s for the raylet to register). The start is made again; the processes the
    first try left (GCS, raylet, agents) are ended before it, and the second try's instance serves."""
    env = os.environ | {"PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run(
        [sys.executable, "-c", SLOW_FIRST_START], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT"))
    assert result == "RESULT [0, 0] 1.0", done.stdout  # nothing left from the first try when the second starts
    warning = next(line for line in done.stdout.splitlines() if line.startswith("neuron_app.scale.local_ray"))
    assert "ran out of its 30 s" in warning and "try 2 of 3" in warning, warning


def test_replicas_of_tp_groups_are_laid_on_aligned_blocks_and_refused_in_one_line_when_they_do_not_fit() -> None:
    """Issue 56: replicas > 1 with tp_degree > 1 are TP groups, each on its own aligned block; more than the cores
    held is refused at start in one line naming both."""
    from neuron_app.errors import SettingsError
    from neuron_app.scale.topology import choose
    from neuron_app.settings import load_settings

    two = load_settings(**TINY_OVERRIDES | {"device": "neuron-emulated"}, replicas=2, tp_degree=2)
    assert choose(two, [0, 1, 2, 3]).core_blocks == [[0, 1], [2, 3]]
    with pytest.raises(SettingsError, match=r"2 copies of TP 2 \(together\) need 4 NeuronCores") as err:
        choose(two, [0, 1, 2])
    assert "\n" not in str(err.value) and "this host holds 3 (cores 0-2)" in str(err.value)


@pytest.mark.timeout(1800)  # Ray, two replicas and the model: 7 min to come up beside two CPU hogs and the suite
def test_python_app_py_with_two_replicas_compiles_once_per_cluster_and_stops_its_ray(
    run_app_py: Callable[..., AppProcess],
) -> None:
    """`NEURON_APP_REPLICAS=2 python app.py` on neuron-emulated (the neuron path in each replica: prepare_process,
    the rules; its NEFF-style artifacts on disk, which are the point here): two concurrent first requests for one
    cold shape land on both replicas; one compiles from scratch, the other waits on the graph's lock and loads it
    from disk. Status, /readyz and /metrics cover both replicas; SIGTERM stops them and the Ray instance the app
    started."""
    from gradio_client import Client

    from tests.support import PATIENT_HTTP

    app = run_app_py(replicas=2, device="neuron-emulated", resolutions=["64x64"], log_level="INFO")
    app.wait_up(timeout=720)
    client = Client(app.url, verbose=False, httpx_kwargs=PATIENT_HTTP)
    jobs = [client.submit("a lighthouse", "64x64", 2, seed, api_name="/generate") for seed in (1, 2)]
    infos = [job.result(timeout=600)[1] for job in jobs]  # a cold compile on a busy host took more than 240 s
    assert sorted(info["cache"] for info in infos) == ["disk", "miss"], infos
    assert infos[0]["replica"] != infos[1]["replica"]
    assert all("eager_compiles" in info for info in infos)

    status = wait_for(
        lambda: (s := client.predict(api_name="/status"))["shapes"]["64x64"]["ready_replicas"] == 2 and s,
        30,
        "both replicas to report 64x64 ready",
    )
    assert [r["healthy"] for r in status["replicas"]] == [True, True] and status["device"] == "neuron-emulated"
    assert status["shapes"]["64x64"]["state"] == "ready" and status["compiles"] >= 1
    with urllib.request.urlopen(app.url + "readyz", timeout=10) as resp:
        body = json.loads(resp.read())
    assert resp.status == 200 and body["ready_replicas"] == 2
    with urllib.request.urlopen(app.url + "metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert metrics.count("neuron_app_replica_healthy{") == 2

    pids = [r["pid"] for r in status["replicas"]]
    app.proc.send_signal(signal.SIGTERM)
    assert app.proc.wait(timeout=90) == 0, app.output()[-3000:]
    wait_for(lambda: not any(pid_alive(pid) for pid in pids), 30, "the replica processes to exit")
    assert "Traceback" not in app.output()


def test_a_replica_that_cannot_load_the_model_fails_the_start_in_one_line(
    run_app_py: Callable[..., AppProcess], tmp_path: Path
) -> None:
    """Same one-line error as the single-process app (checked before Ray starts), exit code 2."""
    app = run_app_py(replicas=2, model=str(tmp_path / "missing-model"))
    assert app.proc.wait(timeout=60) == 2
    lines = [line for line in app.output().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "does not exist" in lines[0]
    assert "Traceback" not in app.output()


# --- one running cluster, joined through ray_address ----------------------------------------------------------
#: The routing test's own shape (48 tokens: a graph no other shape here shares), so that its first request compiles
#: whichever of the module's tests ran before it.
SHAPE = "128x96"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An already running cluster the app joins."""
    with ray_head(tmp_path_factory.mktemp("ray")) as address:
        yield address


@pytest.fixture(scope="module")
def replicas(cluster: str, tmp_path_factory: pytest.TempPathFactory, shared_models: Path) -> Iterator[Any]:
    from neuron_app.scale.replicas import start_replicas
    from neuron_app.settings import load_settings

    cache = link_models(tmp_path_factory.mktemp("replicas"), shared_models)
    shapes = {"resolutions": [*TEST_SHAPES, SHAPE]}
    # The default shape (64x64) is warmed on both replicas, as `warmup = "default"` does for a user: a ready-shape
    # request then has a holder free whichever replica a cold compile lands on (the cold-compile test below).
    others = {"cache_dir": cache, "replicas": 2, "ray_address": cluster, "warmup": "default"}
    settings = load_settings(**(TINY_OVERRIDES | shapes | others))
    client = start_replicas(settings)
    warm_replicas(client)  # two healthy replicas, each with the default shape compiled
    yield client
    # close() stops this app's replicas but never the cluster it joined: checked after the module's last test,
    # whichever it was (a test that closed the shared replicas had to run last, and a random order broke that).
    client.close()
    import ray

    ray.init(address=cluster, namespace="check", logging_level="WARNING")
    try:
        assert ray.cluster_resources().get("CPU") == 2.0, "closing the replicas stopped the cluster they joined"
    finally:
        ray.shutdown()


def warm_replicas(client: Any) -> set[str]:
    """Wait until two healthy replicas hold the default shape (their warm-up done: a replica that replaces a killed
    one warms up too, and its compile counts in `compiles`); returns their ids."""

    def healthy_and_warm() -> set[str] | None:
        rows = [r for r in client.status().replicas if r["healthy"]]
        return {r["id"] for r in rows} if len(rows) == 2 and all("64x64" in r["ready_shapes"] for r in rows) else None

    return wait_for(healthy_and_warm, 120, "two healthy replicas with 64x64 warm")


def routed_holders(client: Any, graph_id: str) -> list[str]:
    """The replicas Serve's router (in this process) knows to hold a graph: it learns them from the controller's
    long poll, after the replica reports them. Read from Serve's router state, which has no public accessor."""
    router = client.handle._router._asyncio_router.request_router
    assert type(router).__name__ == "GraphAffinityRouter"  # the deployment's router, not Serve's default
    holders, *_ = router.rank_replicas_via_multiplex(list(router._replicas.values()), graph_id)
    return [r.replica_id.unique_id for r in holders]


def test_two_replicas_serve_and_routing_prefers_the_replica_with_the_graph(replicas: Any) -> None:
    """The first request of a shape compiles on one replica; every later request of it is routed there (no second
    compile anywhere), and the record says which replica served it."""
    seen: list[Any] = []
    warm_replicas(replicas)  # a replaced replica's warm-up would count as a compile here
    compiles = replicas.status().compiles
    unsubscribe = replicas.subscribe(seen.append)
    first = replicas.generate("a fox", SHAPE, 2, 0)
    assert first.compiled and first.replica and first.image.size == (128, 96)
    # The replica reports the graph it now holds (Serve's multiplexed ids, the status board) asynchronously: a
    # request sent in the same instant may still be routed by load alone (seen once in a full run).
    wait_for(lambda: replicas.status().shapes[SHAPE].ready_replicas == 1, 30, "the graph to be reported")
    wait_for(lambda: routed_holders(replicas, f"graph-{SHAPE}") == [first.replica], 30, "Serve's router to learn it")
    later = [replicas.generate("a fox", SHAPE, 2, seed) for seed in range(1, 7)]
    unsubscribe()
    # The router (routing.GraphAffinityRouter) waits for the holder, which looks busy for an instant after each
    # answer; Serve's default router sent every other request elsewhere (CI, stop 37: the replicas alternated).
    assert sum(r.replica == first.replica for r in later) >= 5, [r.replica for r in later]
    assert not any(r.compiled for r in later)
    # Replicas publish their status every half second (and after each request): the merged view follows.
    status = wait_for(
        lambda: (st := replicas.status()).shapes[SHAPE].ready_replicas >= 1 and st, 30, "the status to follow"
    )
    assert status.compiles == compiles + 1 and status.shapes[SHAPE].state == "ready"
    assert [type(e).__name__ for e in seen].count("GenerationRecord") == 7  # local subscribers (metrics) see them
    assert later[0].info()["replica"] == first.replica


def test_bad_requests_are_refused_before_any_replica_work(replicas: Any) -> None:
    from neuron_app.errors import RequestError

    before = replicas.status().compiles
    for args in (("", "64x64", 2, 0), ("x", "96x96", 2, 0), ("x", "64x64", 99, 0)):
        with pytest.raises(RequestError):
            replicas.generate(*args)
    assert replicas.status().compiles == before


def test_a_ready_shape_is_served_by_the_other_replica_during_a_cold_compile(replicas: Any) -> None:
    """While one replica compiles a cold shape, a ready-shape request is served by the other replica before the
    compile ends: a cold compile no longer freezes the service. The latency ratio (ready request during a compile
    vs solo, 1 vs 2 replicas) is measured by the bench's `replicas` section: no timed assertion here."""
    # Both replicas hold 64x64 (the fixture's warm-up) and Serve's router knows it: whichever replica the cold
    # compile takes, the ready request has a free holder and compiles nothing. With one holder, a cold compile that
    # landed on it sent the ready request to the other replica to load 64x64, a race with the compile (CI, stop 59).
    replicas.generate("warm", "64x64", 2, 0)  # this process's router starts with its first request
    holders = warm_replicas(replicas)
    wait_for(lambda: set(routed_holders(replicas, "graph-64x64")) == holders, 30, "the router to know both holders")
    cold: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: cold.setdefault("record", replicas.generate("cold", "128x128", 2, 0)))
    worker.start()
    wait_for(lambda: replicas.status().shapes["128x128"].state == "compiling", 30, "the cold compile to start")
    ready = replicas.generate("during", "64x64", 2, 7)
    still_compiling = worker.is_alive()
    worker.join(timeout=120)
    assert cold["record"].compiled and cold["record"].replica != ready.replica and not ready.compiled
    assert still_compiling, "the cold compile ended before the ready request: it did not run during the compile"


def test_options_flow_through_to_the_replica_unchanged(replicas: Any) -> None:
    """The client forwards every keyword option of generate (LoRA here; editing's references the same way) to the
    replica, whose manager builds the record from it; a refused value reads as the manager's own refusal."""
    from neuron_app.errors import RequestError

    record = replicas.generate("options", "64x64", 2, 3, lora="none", lora_scale=0.5)
    assert record.image is not None and record.lora == "none"  # `none` is no style: its scale is not kept
    with pytest.raises(RequestError, match="lora_scale"):  # yet the scale did reach the replica's validation
        replicas.generate("options", "64x64", 2, 3, lora="none", lora_scale=7.0)
    with pytest.raises(RequestError, match="LoRA style 'nope' is not offered"):
        replicas.generate("options", "64x64", 2, 3, lora="nope")
    with pytest.raises(TypeError):  # an option nobody knows is refused, not silently dropped
        replicas.generate("options", "64x64", 2, 3, no_such_option=1)


def test_a_refusal_on_the_replica_arrives_as_the_managers_error_with_its_fields(replicas: Any) -> None:
    """Replicas re-validate what they receive: sent past the client's checks, a bad request is refused there, and
    Ray's `.cause` is the manager's own `RequestError` with its `param` (no class names parsed from text)."""
    from neuron_app.errors import RequestError
    from neuron_app.scale.replicas import _unwrap

    fields = {"prompt": "x", "resolution": "64x64", "steps": 99, "seed": 0, "lora": "none", "lora_scale": 1.0}
    with pytest.raises(Exception) as caught:
        replicas.handle.generate.remote(fields | {"references": None}).result(timeout_s=120)
    error = _unwrap(caught.value)
    assert type(error) is RequestError and error.param == "steps" and error.kind == "refused"
    assert str(error).startswith("steps must be between 1 and ")


def test_references_given_as_a_local_path_reach_the_replica_as_bytes(replicas: Any, tmp_path: Path) -> None:
    """An edit's reference uploaded to the front end is a file on its disk: the replica (possibly on another node)
    gets its bytes, so the record reports the upload's own size and hash."""
    import hashlib

    from PIL import Image

    path = tmp_path / "ref.png"
    Image.new("RGB", (96, 80), (200, 30, 30)).save(path)
    record = replicas.generate("edit", "64x64", 2, 5, references=[str(path)])
    assert record.image.size == (64, 64)
    assert [r["size"] for r in record.references] == ["96x80"]
    assert record.references[0]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_killed_replica_costs_at_most_its_request_and_is_replaced(replicas: Any) -> None:
    """SIGKILL the replica running a request (a cold compile): the request is retried once on the other replica
    (seeded, so the same image), the page's status keeps answering, and Ray Serve replaces the dead replica."""
    results: dict[str, Any] = {}

    def run() -> None:
        try:
            results["record"] = replicas.generate("doomed", "128x64", 2, 11)
        except Exception as exc:
            results["error"] = exc

    worker = threading.Thread(target=run)
    worker.start()
    busy = wait_for(
        lambda: next((r for r in replicas.status().replicas if r["healthy"] and r["in_flight"]), None),
        30,
        "a replica to take the request",
    )
    os.kill(busy["pid"], signal.SIGKILL)
    assert replicas.status().replicas  # status answers while the replica is down
    worker.join(timeout=180)
    record = results.get("record")
    assert record is not None, results.get("error")
    assert record.replica != busy["id"]
    wait_for(
        lambda: (
            sum(1 for r in replicas.status().replicas if r["healthy"]) == 2
            and all(r["pid"] != busy["pid"] for r in replicas.status().replicas if r["healthy"])
        ),
        120,
        "Ray Serve to replace the killed replica",
    )
    again = replicas.generate("after", "128x64", 2, 11)
    diff = [abs(a - b) for a, b in zip(again.image.tobytes(), record.image.tobytes(), strict=True)]
    assert max(diff) <= 2  # seeded: the same image (up to float rounding between processes)
    warm_replicas(replicas)  # the replacement's warm-up ends here, not in the middle of the module's next test
