"""Asynchronous jobs of the OpenAI-compatible API and their signed webhooks (web/jobs/jobs.py, web/jobs/webhooks.py).

Driven by the `openai` SDK (`extra_headers={"Prefer": "respond-async"}`, raw responses for the 202 and its
Location) and httpx for GET/DELETE; webhooks go to a loopback receiver (http.server on a free port) and are
verified with the `standardwebhooks` package, an implementation independent of the app's signing.
"""

from __future__ import annotations

import base64
import io
import secrets
import signal
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from PIL import Image
from standardwebhooks import Webhook

from neuron_app.errors import RequestError
from neuron_app.web.jobs.webhooks import Allowlist, deliver, sign
from tests.support import AppProcess, free_port, openai_client

SECRET = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
KEY = f"sk-jobs-{uuid.uuid4().hex}"
OTHER_KEY = f"sk-other-{uuid.uuid4().hex}"
ASYNC = {"Prefer": "respond-async"}
PROMPT = "a lighthouse at dawn"


class Receiver:
    """A loopback webhook endpoint: records every POST (body and headers); answers `statuses` in turn, then 200."""

    def __init__(self, statuses: tuple[int, ...] = ()) -> None:
        self.received: list[tuple[bytes, dict[str, str]]] = []
        self.statuses = list(statuses)
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                owner.received.append((body, dict(self.headers.items())))
                self.send_response(owner.statuses.pop(0) if owner.statuses else 200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}/hooks/image?src=test"

    def wait(self, count: int, timeout: float = 60.0) -> list[tuple[bytes, dict[str, str]]]:
        deadline = time.monotonic() + timeout
        while len(self.received) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(self.received) >= count, f"{len(self.received)} webhook(s) of {count} arrived"
        return self.received

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rec = Receiver()
    yield rec
    rec.close()


@pytest.fixture(scope="module")
def jobs_app(launch_tiny: Callable[..., Any]) -> Any:
    """The model loaded and 64x64 compiled here, whichever test runs first: a job sent while the model loads is a
    503 ("the model is loading"), which the first test in file order used to absorb for the rest."""
    keys = {"alice": {"key": KEY}, "bob": {"key": OTHER_KEY}}
    app = launch_tiny(api_keys=keys, webhook_hosts=["127.0.0.1"], webhook_secret=SECRET)
    app.manager.compile_shape("64x64")
    return app


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def wait_for(app: Any, job_id: str, statuses: tuple[str, ...] = ("succeeded", "failed"), timeout: float = 300) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = httpx.get(app.url + f"v1/images/jobs/{job_id}", headers=auth(), timeout=10)
        assert reply.status_code == 200, reply.text
        if reply.json()["status"] in statuses:
            return reply.json()
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not reach {statuses}: {reply.json()}")


def png(b64: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    image.load()
    return image


def test_a_202_job_succeeds_with_image_data_and_its_webhook_verifies(jobs_app: Any, receiver: Receiver) -> None:
    raw = openai_client(jobs_app, KEY, timeout=120).images.with_raw_response.generate(
        prompt=PROMPT,
        size="64x64",
        extra_headers=ASYNC,
        extra_body={"seed": 3, "num_inference_steps": 2, "webhook_url": receiver.url},
    )
    assert raw.status_code == 202
    job = raw.http_response.json()
    assert job["object"] == "image.job" and job["status"] in ("queued", "running") and job["id"].startswith("imgjob_")
    assert raw.headers["location"] == f"/v1/images/jobs/{job['id']}" and job["created"] > 0

    done = wait_for(jobs_app, job["id"])
    assert done["status"] == "succeeded", done
    image = png(done["data"][0]["b64_json"])
    assert image.size == (64, 64) and image.text["seed"] == "3"
    assert done["data"][0]["provenance"]["seed"] == 3 and done["size"] == "64x64"

    body, headers = receiver.wait(1)[0]
    payload = Webhook(SECRET).verify(body, headers)  # raises unless the signature and timestamp are right
    assert payload["type"] == "image.job.succeeded" and payload["data"]["id"] == job["id"]
    assert headers["webhook-id"] == f"msg_{job['id']}" and headers["webhook-signature"].startswith("v1,")
    assert "b64_json" not in body.decode()  # the webhook says the job ended; the images are fetched with GET
    with pytest.raises(Exception, match="signature"):
        Webhook("whsec_" + base64.b64encode(b"x" * 32).decode()).verify(body, headers)  # another secret fails
    record = wait_for(jobs_app, job["id"])["webhook"]
    deadline = time.monotonic() + 120  # a backstop: delivery is a thread's HTTP post, seconds late on a busy machine
    while not record.get("delivered") and time.monotonic() < deadline:
        time.sleep(0.1)
        record = wait_for(jobs_app, job["id"])["webhook"]
    assert record["delivered"] and record["attempts"] == 1 and record["url"] == receiver.url


def test_a_running_job_shows_its_compile_with_the_estimate_then_succeeds(jobs_app: Any) -> None:
    """A cold shape (128x128; 64x64 was compiled and measured above): while it compiles, the job says so with the
    status table's estimate (scaled from the measured 64x64 compile), from the manager's progress events."""
    warm = httpx.post(  # 64x64 compiled and measured, whichever tests ran before (a no-op when it was)
        jobs_app.url + "v1/images/generations", json={"prompt": PROMPT, "size": "64x64"}, headers=auth(), timeout=300
    )
    assert warm.status_code == 200, warm.text
    assert jobs_app.manager.status().shapes["64x64"].estimate_s is not None  # the history 128x128's estimate uses
    client = httpx.Client(base_url=jobs_app.url, headers=auth() | ASYNC, timeout=30)
    job_id = client.post("v1/images/generations", json={"prompt": PROMPT, "size": "128x128"}).json()["id"]
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        view = client.get(f"v1/images/jobs/{job_id}").json()
        if view["status"] in ("succeeded", "failed"):
            break
        if "progress" in view:
            seen.append(view["progress"])
        time.sleep(0.02)
    assert view["status"] == "succeeded", view
    compiling = [p for p in seen if p.get("phase") == "compiling"]
    assert compiling, seen
    estimate = compiling[-1]["estimate"]
    assert estimate["kind"] == "compile" and estimate["seconds"] > 0 and "64x64" in estimate["basis"], estimate
    assert compiling[-1]["resolution"] == "128x128" and compiling[-1]["message"]


def test_url_jobs_and_edits_take_the_same_path(jobs_app: Any) -> None:
    """An edit (multipart) is a job the same way; response_format=url keeps the synchronous API's URLs."""
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (20, 120, 200)).save(buffer, format="PNG")
    raw = openai_client(jobs_app, KEY, timeout=120).images.with_raw_response.edit(
        image=("ref.png", buffer.getvalue(), "image/png"),
        prompt="the same, at night",
        size="64x64",
        response_format="url",
        extra_headers=ASYNC,
        extra_body={"seed": 5, "num_inference_steps": 1},
    )
    assert raw.status_code == 202
    done = wait_for(jobs_app, raw.http_response.json()["id"])
    assert done["status"] == "succeeded", done
    url = done["data"][0]["url"]
    assert url.startswith(jobs_app.url + "v1/images/files/")
    assert Image.open(io.BytesIO(httpx.get(url, timeout=10).content)).size == (64, 64)


def test_a_bad_job_is_a_400_at_submit_and_only_its_key_sees_a_job(jobs_app: Any) -> None:
    client = httpx.Client(base_url=jobs_app.url, headers=auth() | ASYNC, timeout=30)
    reply = client.post("v1/images/generations", json={"prompt": PROMPT, "size": "96x96"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "size"
    reply = client.post("v1/images/generations", json={"prompt": PROMPT})
    assert reply.status_code == 202
    job_id = reply.json()["id"]
    plain = client.post("v1/images/generations", json={"prompt": PROMPT, "webhook_url": "http://127.0.0.1/"},
                        headers={"Prefer": ""})  # fmt: skip
    assert plain.status_code == 400 and plain.json()["error"]["param"] == "webhook_url"
    for bad_id in ("imgjob_" + "A" * 24, "jobs.sqlite3", job_id + "x"):
        reply = client.get(f"v1/images/jobs/{bad_id}")
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "job_not_found"
    assert client.get("v1/images/jobs/..%2F..%2Fjobs.sqlite3").status_code == 404
    assert httpx.get(jobs_app.url + f"v1/images/jobs/{job_id}", timeout=10).status_code == 401
    wait_for(jobs_app, job_id)
    other = {"Authorization": f"Bearer {OTHER_KEY}"}
    for method in ("GET", "DELETE"):  # another key's job is as unknown as a missing one
        reply = httpx.request(method, jobs_app.url + f"v1/images/jobs/{job_id}", headers=other, timeout=10)
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "job_not_found"


def test_link_local_metadata_and_unlisted_hosts_are_400_without_any_connection(
    jobs_app: Any, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The app runs in this process: every socket connect is recorded (and then made as usual)."""
    connects: list[Any] = []
    original = socket.socket.connect

    def recording(self: socket.socket, address: Any) -> Any:
        connects.append(address)
        return original(self, address)

    monkeypatch.setattr(socket.socket, "connect", recording)
    client = httpx.Client(base_url=jobs_app.url, headers=auth() | ASYNC, timeout=30)
    unlisted = f"http://127.0.0.2:{receiver.port}/"  # loopback too, but not the listed address
    for url in (
        "http://169.254.169.254/latest/meta-data",
        "http://[fd00:ec2::254]/latest/meta-data",
        "http://[::ffff:169.254.169.254]/",
        "http://10.0.0.1/hook",
        "http://localhost:9/hook",
        unlisted,
        "ftp://127.0.0.1/x",
        "http://user:pw@127.0.0.1/x",
        "not a url",
    ):
        connects.clear()
        reply = client.post("v1/images/generations", json={"prompt": PROMPT, "webhook_url": url})
        assert reply.status_code == 400, (url, reply.text)
        error = reply.json()["error"]
        assert error["param"] == "webhook_url" and error["code"] == "invalid_webhook_url", (url, error)
        assert not [a for a in connects if a[0] != "127.0.0.1" or a[1] == 9], (url, connects)
    assert receiver.received == []


def test_the_allowlist_checks_every_resolved_address_at_submit_and_at_send() -> None:
    """Host names go through the resolver: a listed name that resolves (or later rebinds) to a link-local or an
    unlisted private address is refused, and `deliver` refuses to send (checked again before each attempt)."""
    answers = {"hooks.example.com": ["93.184.215.14"]}
    allow = Allowlist(["hooks.example.com", "internal.example.com", "10.1.0.0/16"], lambda h, p: answers[h])
    assert allow.check("https://hooks.example.com/x?y=1").connect_url() == "https://93.184.215.14:443/x?y=1"
    answers["internal.example.com"] = ["10.1.2.3"]
    assert allow.check("http://internal.example.com:8080/").host_header() == "internal.example.com:8080"
    for rebound in (["93.184.215.14", "169.254.169.254"], ["10.2.0.1"], ["127.0.0.1"], ["::ffff:169.254.169.254"]):
        answers["hooks.example.com"] = rebound
        with pytest.raises(RequestError) as caught:
            allow.check("https://hooks.example.com/x")
        assert caught.value.param == "webhook_url"
        record = deliver(allow, "https://hooks.example.com/x", SECRET, "msg_1", b"{}", sleep=lambda s: None)
        assert record == {"delivered": False, "attempts": 1, "status": None, "last_error": str(caught.value)}
    with pytest.raises(RequestError, match="not in this server's webhook_hosts"):
        allow.check("https://other.example.com/")
    with pytest.raises(RequestError, match="webhooks are off"):
        Allowlist([]).check("https://hooks.example.com/")
    with pytest.raises(RequestError, match="link-local"):
        Allowlist(["169.254.0.0/16"]).check("http://169.254.169.254/")  # never, even when listed


def test_a_failed_delivery_is_retried_with_the_same_id_and_a_fresh_signature() -> None:
    rec = Receiver(statuses=(500, 503))
    try:
        pauses: list[float] = []
        record = deliver(Allowlist(["127.0.0.1"]), rec.url, SECRET, "msg_retry", b'{"a":1}', sleep=pauses.append)
        assert record == {"delivered": True, "attempts": 3, "status": 200, "last_error": None}
        assert pauses == [1.0, 5.0]  # bounded backoff: 1 s, 5 s, 25 s, then given up
        for body, headers in rec.received:
            assert headers["webhook-id"] == "msg_retry" and Webhook(SECRET).verify(body, headers) == {"a": 1}
        stamp = int(rec.received[0][1]["webhook-timestamp"])
        assert rec.received[0][1]["webhook-signature"] == sign(SECRET, "msg_retry", stamp, b'{"a":1}')
    finally:
        rec.close()
    gone = deliver(Allowlist(["127.0.0.1"]), f"http://127.0.0.1:{free_port()}/", SECRET, "m", b"{}", sleep=lambda s: 0)
    assert not gone["delivered"] and gone["attempts"] == 4 and gone["last_error"]


def test_a_queued_job_is_cancelled_and_gives_its_place_back(jobs_app: Any) -> None:
    """With the device held (as by a long compile), the first job runs (waiting for the device) and the second
    waits in the queue: DELETE cancels the queued one; the running one then succeeds (a running job's cancel:
    tests/web/test_cancel.py)."""
    client = httpx.Client(base_url=jobs_app.url, headers=auth() | ASYNC, timeout=30)
    body = {"prompt": PROMPT, "size": "64x64", "num_inference_steps": 1}
    jobs_app.manager.ensure_loaded()  # first in a random order, the second job would meet "the model is loading"
    with jobs_app.manager._device_lock:
        first = client.post("v1/images/generations", json=body).json()["id"]
        wait_for(jobs_app, first, ("running",), timeout=30)
        second = client.post("v1/images/generations", json=body).json()
        assert second["status"] == "queued" and second["queue_position"] == 1  # the first job is ahead of it
        running = client.get(f"v1/images/jobs/{first}").json()
        assert running["status"] == "running" and running["progress"]["elapsed_s"] >= 0
        assert running["progress"]["phase"] == "starting" and running["progress"]["message"]  # even before events
        reply = client.delete(f"v1/images/jobs/{second['id']}")
        assert reply.status_code == 200 and reply.json()["status"] == "cancelled"
    assert wait_for(jobs_app, first)["status"] == "succeeded"
    assert client.get(f"v1/images/jobs/{second['id']}").json()["status"] == "cancelled"
    assert client.delete(f"v1/images/jobs/{second['id']}").json()["status"] == "cancelled"  # as it is


@pytest.mark.timeout(900)  # two app.py starts and model loads: minutes on a loaded 2-core machine
def test_finished_jobs_outlive_a_restart_and_a_cut_job_reads_failed(
    run_app_py: Callable[..., AppProcess], receiver: Receiver
) -> None:
    """`python app.py`: one job finishes, another is cut by SIGKILL (the process stopped first, so the job is
    certainly unfinished); a new app on the same cache folder serves the first as it was and the second as failed
    "the server restarted", and the cut job's webhook says so."""
    env = {"NEURON_APP_WEBHOOK_SECRET": SECRET}
    first = run_app_py(env=env, api_key=KEY, webhook_hosts=["127.0.0.1"])
    first.wait_up(timeout=240)
    client = httpx.Client(base_url=first.url, headers=auth() | ASYNC, timeout=120)
    done_id = client.post("v1/images/generations", json={"prompt": PROMPT, "seed": 9}).json()["id"]
    done = wait_for(first, done_id)
    assert done["status"] == "succeeded"
    body = {"prompt": PROMPT, "size": "128x128", "n": 4, "num_inference_steps": 8, "webhook_url": receiver.url}
    cut_id = client.post("v1/images/generations", json=body).json()["id"]
    first.proc.send_signal(signal.SIGSTOP)
    with sqlite3.connect(first.cache_dir / "jobs.sqlite3") as db:
        (status,) = db.execute("SELECT status FROM jobs WHERE id = ?", (cut_id,)).fetchone()
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(timeout=30)
    assert status in ("queued", "running")

    again = run_app_py(env=env, api_key=KEY, webhook_hosts=["127.0.0.1"], cache_dir=str(first.cache_dir))
    again.wait_up(timeout=240)
    kept = wait_for(again, done_id)
    assert kept["status"] == "succeeded" and kept["data"] == done["data"]
    cut = wait_for(again, cut_id)
    assert cut["status"] == "failed" and cut["error"]["code"] == "server_restarted"
    assert "the server restarted" in cut["error"]["message"]
    payload = Webhook(SECRET).verify(*receiver.wait(1)[0])
    assert payload["type"] == "image.job.failed" and payload["data"]["error"]["code"] == "server_restarted"


def test_jobs_and_their_images_are_deleted_after_the_ttl(tmp_path: Any) -> None:
    from neuron_app.web.jobs.job_store import JobStore

    files = tmp_path / "files"
    store = JobStore(tmp_path / "jobs.sqlite3", files, ttl_s=60)
    now = time.time()
    for job_id, finished in (("old", now - 61), ("new", now - 59), ("open", None)):
        store.insert({"id": job_id, "status": "succeeded", "created": now - 100, "finished": finished})
        (files / job_id).mkdir(parents=True)
        (files / job_id / "0.png").write_bytes(b"png")
    assert store.prune() == 1
    assert store.get("old") is None and not (files / "old").exists()
    assert store.get("new") and (files / "new" / "0.png").exists() and store.get("open")
    store.close()


def test_webhook_settings_are_checked_at_start() -> None:
    """webhook_hosts needs a well-formed secret; an entry with a scheme or port (which would match nothing) is
    refused; replicas reads "MIN-MAX" and stays an int (its MAX) for every caller."""
    from neuron_app.errors import SettingsError
    from neuron_app.settings import load_settings

    with pytest.raises(SettingsError, match="NEURON_APP_WEBHOOK_SECRET is not"):
        load_settings(model="tiny", webhook_hosts=["127.0.0.1"])
    with pytest.raises(SettingsError, match="webhook_secret must be 'whsec_'"):
        load_settings(model="tiny", webhook_hosts=["127.0.0.1"], webhook_secret="whsec_c2hvcnQ=")
    for bad in ("https://hooks.example.com", "hooks.example.com:443", "hooks.example.com/x"):
        with pytest.raises(SettingsError, match="is not a host name, an IP address or a network"):
            load_settings(model="tiny", webhook_hosts=[bad], webhook_secret=SECRET)
    settings = load_settings(model="tiny", replicas="1-3")
    assert (settings.replicas, settings.replicas_min, settings.replicas_max, settings.autoscaling) == (3, 1, 3, True)
    assert settings.device_lanes == 3 and settings.uses_replicas
    fixed = load_settings(model="tiny", replicas=2)
    assert (fixed.replicas_min, fixed.replicas_max, fixed.autoscaling) == (2, 2, False)
    with pytest.raises(SettingsError, match="MIN is above MAX"):
        load_settings(model="tiny", replicas="3-2")
    with pytest.raises(SettingsError, match="greater than or equal to 1"):
        load_settings(model="tiny", replicas="0-2")
