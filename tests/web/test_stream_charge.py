"""Issue 52 row 15, over loopback: closing a stream once its steps began is no way around a key's limit. A stream
cut after its first partial image stays charged and is booked in the usage table, as a cancelled job is
(tests/web/test_cancel.py); the red team's 2-a-minute key ran 26 such streams in a minute."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from neuron_app.web.openai.streaming import ImageStream
from tests.support import wait_for

ALICE = "alice-key-0123456789abcdef"
BOB = "bob-key-0123456789abcdefgh"


@pytest.fixture(scope="module")
def app(launch_tiny: Callable[..., Any]) -> Any:
    """64x64 compiled here: the per-minute limits are counted on the clock, and a stream's reads wait at most 60 s,
    neither of which should have to cover a first-use compile on a busy host."""
    keys = {"alice": {"key": ALICE, "images_per_minute": 2}, "bob": {"key": BOB, "images_per_minute": 1}}
    app = launch_tiny(api_keys=keys)
    app.manager.compile_shape("64x64")
    return app


@pytest.fixture
def streams(monkeypatch: pytest.MonkeyPatch) -> list[tuple[ImageStream, threading.Event]]:
    """Each stream the server opens, with an event set once its run has ended and let its charge go."""
    opened: list[tuple[ImageStream, threading.Event]] = []
    respond, work = ImageStream.response, ImageStream.work

    def recorded(self: ImageStream, headers: dict[str, str]) -> Any:
        opened.append((self, threading.Event()))
        return respond(self, headers)

    def watched(self: ImageStream, on_progress: Any) -> Any:
        try:
            return work(self, on_progress)
        finally:
            next(ended for stream, ended in opened if stream is self).set()

    monkeypatch.setattr(ImageStream, "response", recorded)
    monkeypatch.setattr(ImageStream, "work", watched)
    return opened


def booked(app: Any, key: str) -> tuple[float, float, float]:
    """A key's requests, images and device seconds in the usage table today."""
    with sqlite3.connect(app.settings.cache_dir / "usage.sqlite3") as db:
        row = db.execute(
            "SELECT SUM(requests), SUM(images), SUM(device_seconds) FROM usage WHERE key_name = ?", (key,)
        ).fetchone()
    return row[0] or 0.0, row[1] or 0.0, row[2] or 0.0


def post(app: Any, key: str, body: dict[str, Any]) -> Any:
    return httpx.stream("POST", app.url + "v1/images/generations", json=body, timeout=60,
                        headers={"Authorization": f"Bearer {key}"})  # fmt: skip


def test_streams_closed_after_their_first_partial_image_stay_charged_and_are_booked(
    app: Any, streams: list[tuple[ImageStream, threading.Event]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attack: open a stream, read its first partial image, close. The server sees the client go before the
    run's next step (the step waits for that), so each run is cut after steps had run. The third stream of a
    2-a-minute key is a 429, and the usage table shows two requests, no image, and their device seconds."""
    manager = app.manager
    original = manager._execute

    def held(call: Any, on_step: Any = None) -> Any:  # past the partial image's step, wait for the client to go
        if on_step is None:  # a compile's warm-up
            return original(call)

        def step(number: int, total: int, preview: Any = None) -> None:
            if number > 2:
                streams[-1][0].stop.wait(60)
            on_step(number, total, preview)

        return original(call, step)

    monkeypatch.setattr(manager, "_execute", held)
    body = {"prompt": "a red circle", "size": "64x64", "stream": True, "partial_images": 1,
            "num_inference_steps": 4}  # fmt: skip
    statuses: list[int] = []
    for _ in range(4):  # bounded: the attack stops by itself
        with post(app, ALICE, body) as reply:
            statuses.append(reply.status_code)
            if reply.status_code != 200:
                assert reply.status_code == 429 and "rate_limit" in reply.read().decode()
                break
            assert "event: image_generation.partial_image" in reply.iter_lines()
        # closed after the partial image: once the run has ended its charge is settled
        assert streams[-1][1].wait(60), "the run did not end"
    assert statuses == [200, 200, 429], statuses
    requests, images, seconds = booked(app, "alice")
    assert (requests, images) == (2, 0) and seconds > 0, (requests, images, seconds)


def test_a_stream_closed_before_its_first_step_is_given_back(
    app: Any, streams: list[tuple[ImageStream, threading.Event]]
) -> None:
    """Refund only before the first step: a 1-a-minute key whose stream is closed while it waits for the device
    (held here, as by another request's compile) keeps its image, and nothing is booked."""
    body = {"prompt": "a red circle", "size": "64x64", "stream": True, "num_inference_steps": 4}
    with app.manager._device_lock:  # the stream waits before any step
        with post(app, BOB, body) as reply:
            assert reply.status_code == 200
        wait_for(lambda: streams[-1][0].stop.is_set(), 60, "the server to see the client go")
    assert streams[-1][1].wait(60), "the run did not end"
    assert booked(app, "bob") == (0, 0, 0)
    with post(app, BOB, body | {"stream": False}) as again:  # its one image a minute is still there
        assert again.status_code == 200, again.read()
