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
from tests.support import PATIENT_HTTP, wait_for

EDIT_KEY = f"sk-edit-{uuid.uuid4().hex}"
TIGHT_KEY = f"sk-tight-{uuid.uuid4().hex}"
CONNECTIONS = 64
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
        # postprocess_workers 0: one request at a time in Gradio's queue, whose waiting room these tests count
        budgets = {"upload_mb_per_minute": 2, "upload_total_mb": 5, "postprocess_workers": 0}
        launched = launch_tiny(**budgets, queue_max_size=1, max_connections=CONNECTIONS)
    finally:
        os.environ.pop("NEURON_APP_API_KEYS", None)
    # Every test below meets a ready model and 64x64 compiled, whichever runs first: the per-minute limit is charged
    # at admission on the clock, and a first-use compile inside the limited key's first image could outlast it.
    launched.manager.compile_shape("64x64")
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


# --- the door: uploads, the queue, connections (web/door/) --------------------------------------------------


def upload(app: Any, address: str, size: int, **headers: str) -> httpx.Response:
    """What the page and gradio_client do to send a file; the address comes through X-Forwarded-For, which
    uvicorn believes from 127.0.0.1 (FORWARDED_ALLOW_IPS), as from a proxy on the same host."""
    return httpx.post(
        app.url + "gradio_api/upload",
        files={"files": ("blob.bin", os.urandom(size), "application/octet-stream")},
        headers={"X-Forwarded-For": address, **headers},
        timeout=BACKSTOP_S,
    )


def test_uploads_are_limited_per_address_per_minute_and_in_total(app: Any) -> None:
    """`upload_mb_per_minute = 2`: an address's second 1.5 MB upload in a minute is a 429 with Retry-After;
    `upload_total_mb = 5`: the fourth address's upload in the hour is a 507."""
    size = 3 << 19  # 1.5 MB
    first = upload(app, "203.0.113.1", size)
    assert first.status_code == 200, first.text
    again = upload(app, "203.0.113.1", size)
    assert again.status_code == 429 and int(again.headers["Retry-After"]) >= 1
    assert "address 203.0.113.1 is over its limit of 2.0 MB per minute" in again.json()["detail"]
    assert upload(app, "203.0.113.2", size).status_code == 200
    assert upload(app, "203.0.113.3", size).status_code == 200
    full = upload(app, "203.0.113.4", size)
    assert full.status_code == 507 and "the upload space (all addresses) is over its limit" in full.json()["detail"]


def test_an_upload_must_declare_its_size(app: Any) -> None:
    def chunks() -> Iterator[bytes]:
        yield b"--x\r\nContent-Disposition: form-data; name=files; filename=a.bin\r\n\r\nabc\r\n--x--\r\n"

    response = httpx.post(
        app.url + "gradio_api/upload",
        content=chunks(),  # chunked: no Content-Length
        headers={"Content-Type": "multipart/form-data; boundary=x"},
        timeout=BACKSTOP_S,
    )
    assert response.status_code == 411


def test_a_full_gradio_queue_says_when_to_retry(app: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """`queue_max_size = 1`, one lane: with one generation held on the device and one waiting, the next join is
    Gradio's 503, now with a Retry-After."""
    from gradio_client import Client
    from gradio_client.utils import Status

    running, release = threading.Event(), threading.Event()
    real_run = app.manager.generate

    def held_run(*args: Any, **kwargs: Any) -> Any:
        running.set()
        release.wait(BACKSTOP_S)
        return real_run(*args, **kwargs)

    monkeypatch.setattr(app.manager, "generate", held_run)
    client = Client(app.url, verbose=False, httpx_kwargs=PATIENT_HTTP)
    try:
        jobs = [client.submit("a lamp", "64x64", 1, 1, api_name="/generate")]
        assert running.wait(BACKSTOP_S)
        jobs.append(client.submit("a lamp", "64x64", 1, 2, api_name="/generate"))
        config = httpx.get(app.url + "config", timeout=30).json()
        (fn,) = [d["id"] for d in config["dependencies"] if d.get("api_name") == "generate"]
        body = {"data": ["a lamp", "64x64", 1, 3], "fn_index": fn, "session_hash": uuid.uuid4().hex}
        # The second job is sent from the client's thread: a join sent before it arrived took the one place, and the
        # client's job met the 503 (.ci/run beside a second suite). Gradio tells a queued job its rank: wait for it.
        in_queue = lambda: jobs[1].status().code == Status.IN_QUEUE  # noqa: E731
        wait_for(in_queue, BACKSTOP_S, "the second job in Gradio's queue")
        refused = httpx.post(app.url + "gradio_api/queue/join", json=body, timeout=30)
        assert refused.status_code == 503, refused.text
        assert refused.headers["Retry-After"] == "5"
        called = httpx.post(app.url + "gradio_api/call/generate", json={"data": body["data"]}, timeout=30)
        assert called.status_code == 503 and called.headers["Retry-After"] == "5"  # the curl route (row 19)
    finally:
        release.set()
    for job in jobs:
        job.result(timeout=BACKSTOP_S)


# Connections (a header deadline, requests in progress per address): tests/web/test_slow_clients.py.


def test_gradios_monitoring_pages_are_off(app: Any) -> None:
    """Issue 45, row 21: `/monitoring/summary` told anyone every function's counts and timings, and each visit to
    `/monitoring` wrote its secret URL into the server's log."""
    for path in ("monitoring", "monitoring/summary"):
        assert httpx.get(app.url + path, timeout=30).status_code in (403, 404)


def test_the_page_limit_is_on_by_default_when_others_can_reach_the_app(make_settings: Callable[..., Any]) -> None:
    from neuron_app.web.access import REACHABLE_IMAGES_PER_MINUTE, page_limit

    assert page_limit(make_settings()) == 0  # 127.0.0.1: only this machine
    assert page_limit(make_settings(server_name="0.0.0.0")) == REACHABLE_IMAGES_PER_MINUTE == 10
    assert page_limit(make_settings(server_name="0.0.0.0", page_images_per_minute=0)) == 0  # said off: off
    assert page_limit(make_settings(page_images_per_minute=3)) == 3


def test_behind_a_proxy_on_this_host_the_page_limit_and_the_safety_checker_are_on(
    make_settings: Callable[..., Any],
) -> None:
    """Issue 45, row 42: a proxy on the same host forwards to 127.0.0.1, so the app binds to loopback although others
    reach it; `behind_proxy` says so, and the defaults meant for a reachable app turn on."""
    from neuron_app.web.access import REACHABLE_IMAGES_PER_MINUTE, page_limit

    alone, proxied = make_settings(), make_settings(behind_proxy=True)
    assert not alone.reachable_by_others and not alone.safety_on and page_limit(alone) == 0
    assert proxied.server_name == "127.0.0.1" and proxied.reachable_by_others and proxied.safety_on
    assert page_limit(proxied) == REACHABLE_IMAGES_PER_MINUTE


def test_a_full_disk_is_a_507_in_openai_shape(app: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The `url` image is written where the kernel says ENOSPC (/dev/full, a real write that fails as on a full
    disk): the answer is a 507 `insufficient_storage` in OpenAI's shape, naming no path (it used to be a plain 500)."""
    from neuron_app.web.openai import image_urls

    real = image_urls.write_image

    def write_to_a_full_disk(record: Any, target: Any, marker: Any = None, *output: Any) -> Any:
        with open("/dev/full", "wb", buffering=0) as full:
            return real(record, full, marker, *output)

    monkeypatch.setattr(image_urls, "write_image", write_to_a_full_disk)
    response = httpx.post(
        app.url + "v1/images/generations",
        headers={"Authorization": f"Bearer {EDIT_KEY}"},
        json={"prompt": "a lamp", "size": "64x64", "num_inference_steps": 1, "response_format": "url"},
        timeout=BACKSTOP_S,
    )
    assert response.status_code == 507, response.text
    error = response.json()["error"]
    assert error["code"] == "insufficient_storage" and error["type"] == "server_error"
    assert "disk is full" in error["message"] and str(app.settings.cache_dir) not in response.text


def test_the_gradio_api_never_answers_error_null(app: Any) -> None:
    """Gradio's own refusals (too few inputs, a file it will not read) come with a one-line reason through the REST
    route (`/gradio_api/call/...`, what curl users and gradio_client's queue read), with server paths replaced;
    they used to be `{"error": null}`."""
    from neuron_app.web.gradio_errors import scrubbed

    def rest(name: str, data: list[Any]) -> tuple[str, Any]:
        started = httpx.post(f"{app.url}gradio_api/call/{name}", json={"data": data}, timeout=BACKSTOP_S)
        stream = httpx.get(f"{app.url}gradio_api/call/{name}/{started.json()['event_id']}", timeout=BACKSTOP_S)
        lines = [line for line in stream.text.splitlines() if line]
        return lines[-2].removeprefix("event: "), json.loads(lines[-1].removeprefix("data: "))

    event, data = rest("generate", ["a lamp"])
    assert event == "error" and "didn't receive enough input values" in data["error"]
    passwd = {"path": "/etc/passwd", "meta": {"_type": "gradio.FileData"}}
    event, data = rest("edit", ["a lamp", [passwd], "auto", 1, 1, "none", 1.0])
    assert event == "error" and data["error"] and "/etc/passwd" not in data["error"]
    leak = FileNotFoundError(2, "No such file or directory", f"{app.settings.cache_dir}/outputs/x.png")
    assert str(app.settings.cache_dir) not in scrubbed(leak) and "<path>" in scrubbed(leak)
    assert "http://example.com/a/b" in scrubbed(ValueError("see http://example.com/a/b"))


def test_no_server_path_in_any_gradio_answer(app: Any, tmp_path: Any) -> None:
    """Answers name files by alias (`/@outputs/...`, `/@uploads/...`, `/@cache`), never by the server's absolute
    path (every answer used to carry it, in `path` and in its file URL); the aliases work where clients send them
    back: the file URL downloads the PNG, and gradio_client's upload-then-edit reads the uploaded reference."""
    from gradio_client import Client, handle_file

    started = httpx.post(
        f"{app.url}gradio_api/call/generate",
        json={"data": ["a lamp", "64x64", 1, 5, "none", 1.0, None]},
        timeout=BACKSTOP_S,
    )
    stream = httpx.get(f"{app.url}gradio_api/call/generate/{started.json()['event_id']}", timeout=BACKSTOP_S).text
    assert "event: complete" in stream and str(app.settings.cache_dir) not in stream
    image = json.loads(stream.strip().splitlines()[-1].removeprefix("data: "))[0]
    assert image["path"].startswith("/@outputs/")
    download = httpx.get(image["url"], timeout=BACKSTOP_S)
    assert download.status_code == 200 and Image.open(io.BytesIO(download.content)).size == (64, 64)
    for page in ("config", "gradio_api/info"):
        assert str(app.settings.cache_dir) not in httpx.get(app.url + page, timeout=BACKSTOP_S).text
    reference = tmp_path / "reference.png"
    Image.new("RGB", (96, 96), (20, 120, 200)).save(reference)
    uploaded = httpx.post(
        app.url + "gradio_api/upload", files={"files": ("r.png", reference.read_bytes(), "image/png")}, timeout=60
    ).json()
    assert uploaded[0].startswith("/@uploads/")  # not Gradio's upload folder
    edited, record = Client(app.url, verbose=False, httpx_kwargs=PATIENT_HTTP).predict(
        "make it red", [handle_file(str(reference))], "64x64", 1, 6, api_name="/edit"
    )
    assert record["references"][0]["size"] == "96x96" and Image.open(edited).size == (64, 64)
