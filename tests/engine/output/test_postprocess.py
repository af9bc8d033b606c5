"""The post-processing stage (engine/output/postprocess.py): the device lane takes its next request while the last one's
image is in a host slot, waits when every slot is busy, and a flagged image or a failure stays that request's own.

The host work is held up with a real lock of the real signer (every image is signed under it), not with a stand-in:
an image held there is past the device, in its post slot.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from neuron_app.engine.output.postprocess import Lane, PostStage, idle_fraction
from neuron_app.engine.trust.marks import Marker
from neuron_app.errors import ContentRefused
from tests.support import wait_for

PROMPT, SHAPE, STEPS = "a calm lake", "64x64", 2


def start(manager: Any, seed: int, results: dict[int, Any]) -> threading.Thread:
    def run() -> None:
        try:
            results[seed] = manager.generate(PROMPT, SHAPE, STEPS, seed)
        except Exception as exc:
            results[seed] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def manager(tmp_path_factory: pytest.TempPathFactory, shared_models: Any) -> Any:
    """One loaded tiny manager with the safety checker on (its stand-in), 64x64 compiled and the signer made; each
    test gives it the post stage it needs (what `postprocess_workers` sets at start)."""
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.settings import load_settings
    from tests.support import TINY_OVERRIDES, link_models

    cache_dir = link_models(tmp_path_factory.mktemp("cache"), shared_models)
    settings = load_settings(
        **(TINY_OVERRIDES | {"cache_dir": cache_dir, "safety_checker": "on", "safety_model": "tiny"})
    )
    manager = PipelineManager(settings)
    manager.generate(PROMPT, SHAPE, STEPS, 0)
    return manager


@pytest.fixture
def signing_held(request: pytest.FixtureRequest) -> Iterator[Callable[[Any], threading.Lock]]:
    held: list[threading.Lock] = []

    def hold(manager: Any) -> threading.Lock:
        lock = Marker.for_settings(manager.settings).signer._lock
        lock.acquire()
        held.append(lock)
        return lock

    yield hold
    for lock in held:
        if lock.locked():
            lock.release()


def test_the_lane_takes_the_next_request_while_the_host_signs_and_waits_when_the_slots_are_full(
    manager: Any, signing_held: Callable[[Any], threading.Lock]
) -> None:
    manager.post = PostStage(1)
    lane, post = manager._device_lock, manager.post
    holds_before = len(lane.holds)
    lock = signing_held(manager)
    results: dict[int, Any] = {}
    first = start(manager, 1, results)
    wait_for(lambda: post.running == 1 and not lane.locked(), 120, "the first image in its post slot, the lane free")
    second = start(manager, 2, results)
    # the second request ran on the device meanwhile; with the one slot busy its lane waits (backpressure)
    wait_for(lambda: post.waiting == 1 and lane.locked(), 120, "the second request's lane waiting for a slot")
    third = start(manager, 3, results)
    wait_for(lambda: lane.waiting == 1, 60, "a third request waiting for the device")
    stages = manager.status().stages
    assert stages["post"] == stages["post"] | {"workers": 1, "waiting": 1, "running": 1}
    assert stages["device"]["waiting"] == 1 and stages["device"]["running"] == 1
    assert len(lane.holds) == holds_before + 2  # the second request's device work ran while the first image was held
    lock.release()
    for thread in (first, second, third):
        thread.join(120)
    assert [results[s].seed for s in (1, 2, 3)] == [1, 2, 3]
    assert all(results[s].marks["c2pa"].startswith("signed") for s in (1, 2, 3))
    assert manager.status().stages["post"] | {"seconds": 0} == {
        "workers": 1, "waiting": 0, "running": 0, "done": 3, "failed": 0, "seconds": 0,
    }  # fmt: skip


def test_in_line_the_lane_waits_for_the_host_work(manager: Any, signing_held: Callable[[Any], threading.Lock]) -> None:
    manager.post = PostStage(0)
    lane, post = manager._device_lock, manager.post
    lock = signing_held(manager)
    results: dict[int, Any] = {}
    first = start(manager, 1, results)
    wait_for(lambda: post.running == 1, 120, "the first image in the host work")
    second = start(manager, 2, results)
    wait_for(lambda: lane.waiting == 1, 60, "the second request waiting for the device")
    assert lane.locked() and post.running == 1  # the lane is still the first request's: in-line
    lock.release()
    first.join(120)
    second.join(120)
    assert [results[s].seed for s in (1, 2)] == [1, 2]


def test_a_flagged_image_fails_its_own_request_only_and_is_never_encoded(manager: Any) -> None:
    manager.post = PostStage(2)
    manager.safety.threshold = 1e-30  # the stand-in's score for noise is above it: every image is flagged
    results: dict[int, Any] = {}
    flagged = start(manager, 1, results)
    flagged.join(120)
    manager.safety.threshold = 0.5
    passed = start(manager, 2, results)
    passed.join(120)
    assert isinstance(results[1], ContentRefused)
    assert results[2].safety == "passed" and results[2].encoded.data[:4] == b"\x89PNG"
    post = manager.status().stages["post"]
    assert post["failed"] == 1 and post["done"] == 1 and post["running"] == 0
    assert not manager._device_lock.locked()  # the failure in the host stage left the lane free


def test_the_lane_serves_in_arrival_order_and_its_idle_share() -> None:
    lane = Lane()
    order: list[int] = []
    lane.acquire()
    threads = []
    for i in range(4):
        threads.append(threading.Thread(target=lambda i=i: (lane.acquire(), order.append(i), lane.release())))
        threads[-1].start()
        wait_for(lambda i=i: lane.waiting == i + 1, 30, f"waiter {i}")
    lane.release()
    for thread in threads:
        thread.join(30)
    assert order == [0, 1, 2, 3] and not lane.locked()
    assert idle_fraction([(0.0, 1.0), (2.0, 3.0)]) == pytest.approx(1 / 3)
    assert idle_fraction([(0.0, 1.0)]) is None


def test_postprocess_workers_sets_the_stage_and_the_entries_slots(make_settings: Callable[..., Any]) -> None:
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.engine.output.postprocess import request_slots

    settings = make_settings(postprocess_workers=3)
    assert PipelineManager(settings).post.workers == 3 and request_slots(settings) == settings.device_lanes + 3
    assert not PipelineManager(make_settings(postprocess_workers=0)).post.overlapped  # in-line
