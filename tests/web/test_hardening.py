"""Attacks on a shared server (issue 31), each closed and tested with the client an attacker would use.

One launched tiny app with API keys set through the real environment, driven over plain HTTP (httpx) and the
openai SDK. Every wait is on an event (a decode started, an answer came); deadlines are backstops only.
"""

from __future__ import annotations

import io
import json
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from neuron_app.engine.modes import references

EDIT_KEY = f"sk-edit-{uuid.uuid4().hex}"
TIGHT_KEY = f"sk-tight-{uuid.uuid4().hex}"
#: A backstop for one answer on a busy 2-core machine, never the thing measured.
BACKSTOP_S = 120.0


def big_png(side: int) -> bytes:
    """A `side` x `side` 16-bit grayscale PNG of one value: ~100 KB on the wire, `side`^2 x 2 bytes decoded."""
    buffer = io.BytesIO()
    Image.fromarray(np.full((side, side), 1234, dtype=np.uint16)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def app(launch_tiny: Callable[..., Any]) -> Any:
    keys = {"edit": {"key": EDIT_KEY}, "tight": {"key": TIGHT_KEY, "images_per_minute": 1}}
    os.environ["NEURON_APP_API_KEYS"] = json.dumps(keys)
    try:
        launched = launch_tiny()
    finally:
        os.environ.pop("NEURON_APP_API_KEYS", None)
    launched.manager.ensure_loaded()  # every test below meets a ready model, whichever runs first
    return launched


@pytest.fixture(scope="module")
def png_7000() -> bytes:
    data = big_png(7000)
    assert len(data) < 200_000  # the attack: a small upload that decodes to 98 MB
    return data


class Decodes:
    """Counts the reference decodes of the app (it runs in this process) and can hold one until released."""

    def __init__(self, hold: bool) -> None:
        self.started, self.release, self.count = threading.Event(), threading.Event(), 0
        self.hold = hold
        self.real = references.decode

    def __call__(self, image: Any) -> Any:
        self.count += 1
        self.started.set()
        if self.hold:
            self.release.wait(BACKSTOP_S)
        return self.real(image)


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[bool], Decodes]]:
    made: list[Decodes] = []

    def watch(hold: bool = False) -> Decodes:
        watcher = Decodes(hold)
        monkeypatch.setattr(references, "decode", watcher)
        made.append(watcher)
        return watcher

    yield watch
    for watcher in made:
        watcher.release.set()


def edit(app: Any, key: str, *images: bytes, timeout: float = BACKSTOP_S, **fields: str) -> httpx.Response:
    files = [("image[]", (f"ref{i}.png", data, "image/png")) for i, data in enumerate(images)]
    data = {"prompt": "a quiet harbour", "size": "64x64", "num_inference_steps": "1"} | fields
    return httpx.post(
        app.url + "v1/images/edits",
        headers={"Authorization": f"Bearer {key}"},
        data=data,
        files=files,
        timeout=timeout,
    )


def test_healthz_answers_while_an_edit_decodes_two_huge_references(app: Any, png_7000: bytes, decodes: Any) -> None:
    """Two 7000x7000 16-bit references (49 Mpx each, under the default `max_reference_pixels` of 50 M, so a 48 Mpx
    phone photo stays usable) are decoded in a worker thread: `/healthz` answers while a decode is held, and
    the edit is served once it is released."""
    watcher = decodes(hold=True)
    answer: dict[str, httpx.Response] = {}
    sender = threading.Thread(target=lambda: answer.setdefault("edit", edit(app, EDIT_KEY, png_7000, png_7000)))
    sender.start()
    assert watcher.started.wait(BACKSTOP_S), "the edit never reached its decode"
    health = httpx.get(app.url + "healthz", timeout=30)  # a decode on the event loop would hold this answer
    assert health.status_code == 200
    assert not watcher.release.is_set() and watcher.count == 1  # answered while the first decode was still held
    watcher.release.set()
    sender.join(BACKSTOP_S)
    response = answer["edit"]
    assert response.status_code == 200, response.text
    assert watcher.count == 2
    assert response.json()["data"][0]["provenance"]["references"][0]["size"] == "7000x7000"


def test_pixel_budget_is_read_from_every_header_before_any_decode(app: Any, png_7000: bytes, decodes: Any) -> None:
    """A second reference of 8000x8000 (64 Mpx, over `max_reference_pixels`) refuses the edit with a 400 naming
    it, before the first (allowed) one is decoded."""
    watcher = decodes()
    response = edit(app, EDIT_KEY, png_7000, big_png(8000))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "image"
    assert "reference image 2 has too many pixels" in error["message"] and "8000x8000" in error["message"]
    assert watcher.count == 0


def test_a_key_over_its_limit_gets_its_429_before_any_image_is_read(app: Any, png_7000: bytes, decodes: Any) -> None:
    """The order is auth, limits, queue room, pixel budget, decode: a key over its limit costs no decode."""
    first = httpx.post(
        app.url + "v1/images/generations",
        headers={"Authorization": f"Bearer {TIGHT_KEY}"},
        json={"prompt": "a lamp", "size": "64x64", "num_inference_steps": 1},
        timeout=BACKSTOP_S,
    )
    assert first.status_code == 200, first.text
    watcher = decodes()
    response = edit(app, TIGHT_KEY, png_7000, png_7000)
    assert response.status_code == 429, response.text
    assert response.json()["error"]["type"] == "rate_limit_error" and "Retry-After" in response.headers
    assert watcher.count == 0
    wrong = edit(app, "sk-wrong-" + uuid.uuid4().hex, png_7000)
    assert wrong.status_code == 401 and watcher.count == 0


def test_deeply_nested_json_is_a_400_in_openai_shape(app: Any) -> None:
    depth = 200_000
    response = httpx.post(
        app.url + "v1/images/generations",
        headers={"Authorization": f"Bearer {EDIT_KEY}", "Content-Type": "application/json"},
        content=b"[" * depth + b"]" * depth,
        timeout=BACKSTOP_S,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_json"
