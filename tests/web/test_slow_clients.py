"""Slow clients and waiting cancels cannot take the server (issue 45: red-team turn 5, rows 30 and 31).

One launched tiny app with small caps, attacked over loopback with plain sockets and httpx the way the report did
(half-sent headers; many DELETEs of a job that is compiling), each bounded in count and time. Every wait is on an
event or a polled state; deadlines are backstops only.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from neuron_app.engine.records import ProgressEvent
from tests.support import wait_for

CAP, PER_ADDRESS, HEADER_S = 64, 4, 2.0  # CAP above the 45 DELETEs of row 31
#: A backstop for one answer on a busy 2-core machine, never the thing measured.
BACKSTOP_S = 120.0


@pytest.fixture(scope="module")
def app(launch_tiny: Callable[..., Any]) -> Any:
    launched = launch_tiny(max_connections=CAP, max_connections_per_address=PER_ADDRESS, header_timeout_s=HEADER_S)
    launched.manager.ensure_loaded()
    return launched


def client_from(address: str) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=30)


def test_half_sent_requests_beyond_the_cap_neither_refuse_others_nor_stay_open(app: Any) -> None:
    """Row 30: more half-sent requests than `max_connections` (each: a request line and one header, then
    nothing) leave `/healthz` and the API answering, and the server closes each once `header_timeout_s` passed."""
    port = app.settings.server_port
    held = []
    for i in range(CAP + 16):
        sock = socket.create_connection(
            ("127.0.0.1", port), timeout=BACKSTOP_S, source_address=(f"127.0.0.{5 + i % 4}", 0)
        )
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-a: b\r\n")
        held.append(sock)
    try:
        with client_from("127.0.0.9") as client:
            assert client.get(app.url + "healthz").status_code == 200
            models = client.get(app.url + "v1/models")
            assert models.status_code == 200, models.text
        for sock in held:  # closed by the server: recv reads the end of the stream, not a timeout
            assert sock.recv(1024) == b""
    finally:
        for sock in held:
            sock.close()


def test_requests_in_progress_are_capped_per_address_and_healthz_still_answers(app: Any) -> None:
    """An address with `max_connections_per_address` requests in progress (bodies promised, never sent) gets a
    503 with Retry-After for one more; another address and that address's `/healthz` are served."""
    port = app.settings.server_port
    head = b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += b"Content-Length: 99\r\n\r\n"
    held = []
    try:
        for _ in range(PER_ADDRESS):
            sock = socket.create_connection(("127.0.0.1", port), timeout=BACKSTOP_S, source_address=("127.0.0.20", 0))
            sock.sendall(head)
            held.append(sock)
        with client_from("127.0.0.20") as crowded:
            refused = wait_for(
                lambda: (r := crowded.get(app.url + "v1/models")).status_code == 503 and r, BACKSTOP_S, "a 503"
            )
            assert refused.headers["Retry-After"] and "requests in progress" in refused.json()["detail"]
            assert crowded.get(app.url + "healthz").status_code == 200
        with client_from("127.0.0.21") as other:
            assert other.get(app.url + "v1/models").status_code == 200
    finally:
        for sock in held:
            sock.close()


def test_a_forwarded_request_to_a_loopback_app_names_the_setting_once(
    app: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Row 42: requests that come through a proxy (X-Forwarded-For) while the app counts itself as private log one
    warning naming NEURON_APP_BEHIND_PROXY (the page limit and the safety checker are off until it is set)."""
    with caplog.at_level(logging.WARNING, logger="neuron_app.web.guard"):
        for _ in range(3):
            httpx.get(app.url + "v1/models", headers={"X-Forwarded-For": "198.51.100.7"}, timeout=30)
    lines = [r for r in caplog.records if "NEURON_APP_BEHIND_PROXY" in r.getMessage()]
    assert len(lines) == 1


def test_cancels_of_a_compiling_job_hold_no_thread(app: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Row 31: 45 DELETEs (more than the 40 threads of Starlette's pool) and a `cancel_job` call on a job held in
    its compile: all arrive, `/healthz` and `/readyz` answer meanwhile, `cancel_job` answers at once with
    `cancel_requested`, and once the compile ends every DELETE reads `cancelled`."""
    from gradio_client import Client

    from tests.support import PATIENT_HTTP

    compiling, release = threading.Event(), threading.Event()
    real_run = app.manager.run

    def held_run(request: Any, progress: Any = None) -> Any:
        if progress is not None:
            progress(ProgressEvent("compiling", str(request.resolution), message="compiling (held by the test)"))
        compiling.set()
        release.wait(BACKSTOP_S)
        return real_run(request, progress)

    monkeypatch.setattr(app.manager, "run", held_run)
    jobs = app.closers[0].__self__  # the OpenAI API's Jobs (web/jobs/jobs.py)
    calls, real_cancel = [], jobs.cancel
    monkeypatch.setattr(jobs, "cancel", lambda *a: calls.append(1) or real_cancel(*a))
    body = {"prompt": "a slow lamp", "size": "64x64", "num_inference_steps": 4}
    created = httpx.post(app.url + "v1/images/generations", json=body, headers={"Prefer": "respond-async"}, timeout=60)
    assert created.status_code == 202, created.text
    job_url = f"{app.url}v1/images/jobs/{created.json()['id']}"
    answers: list[httpx.Response] = []
    try:
        assert compiling.wait(BACKSTOP_S)

        def delete(i: int) -> None:
            with client_from(f"127.0.1.{i + 1}") as client:
                answers.append(client.delete(job_url, timeout=BACKSTOP_S))

        senders = [threading.Thread(target=delete, args=(i,)) for i in range(45)]
        for sender in senders:
            sender.start()
        wait_for(lambda: len(calls) >= 45, 60, "45 cancels taken in at once")
        assert httpx.get(app.url + "healthz", timeout=10).status_code == 200
        assert "ready" in httpx.get(app.url + "readyz", timeout=10).json()  # answered (a pool thread), ready or not
        tool = Client(app.url, verbose=False, httpx_kwargs=PATIENT_HTTP).predict(
            created.json()["id"], api_name="/cancel_job"
        )
        assert tool["status"] == "running" and tool["cancel_requested"] is True
        assert not release.is_set() and not answers  # all of it while the compile was still held
    finally:
        release.set()
    for sender in senders:
        sender.join(BACKSTOP_S)
    assert len(answers) == 45 and {a.json()["status"] for a in answers} == {"cancelled"}
