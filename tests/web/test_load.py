"""Load: many clients at once against a small queue, on 127.0.0.1 only.

12 gradio_client clients (threads) send 2 requests each to a ready shape of the tiny app whose queue holds 4 and
whose device lane takes one at a time, so the waiting room overflows. Every request must end in one of two ways, a
result or Gradio's clear queue-full answer; none may hang or vanish, a client thread that dies fails the test, and
the status endpoint must keep answering during the load. The clients are built before the load
starts (each fetches the app's config and API info: 32 of them built at once on 2 cores once outlasted the start
barrier), and no figure here depends on how fast the machine is.
"""

from __future__ import annotations

import threading
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from gradio_client import Client
from gradio_client.utils import QueueError

from tests.support import PATIENT_HTTP

CLIENTS, PER_CLIENT = 12, 2
QUEUE_MAX_SIZE = 4
HANG_S = 300.0  # a ceiling for a hung request or thread, never a measure of speed


@pytest.fixture(scope="module")
def busy_app(launch_tiny: Callable[..., Any]) -> Any:
    """The tiny app with a waiting room of 4 and one device lane, 64x64 already compiled."""
    app = launch_tiny(queue_max_size=QUEUE_MAX_SIZE, concurrency_limit=1)
    Client(app.url, verbose=False, httpx_kwargs=PATIENT_HTTP).predict("warm-up", "64x64", 4, 0, api_name="/generate")
    return app


def test_concurrent_clients_get_a_result_or_queue_full(busy_app: Any) -> None:
    """24 requests from 12 concurrent clients: each one either succeeds (with its own seed echoed back) or gets
    "Queue is full! Please try again."; none times out or fails otherwise, the counts add up to 24, nothing
    compiles, and the status answers during the load: always on its unqueued HTTP route
    (POST /gradio_api/run/status) and on GET /readyz, through gradio_client either an answer or queue-full, never a
    hang."""
    outcomes: Counter[str] = Counter()
    unexpected: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(CLIENTS + 1)  # the clients and this thread: the load starts when all are built
    graphs_before = busy_app.manager.counter.graphs
    clients = [Client(busy_app.url, verbose=False, httpx_kwargs=PATIENT_HTTP) for _ in range(CLIENTS)]

    def record(kind: str, detail: str = "") -> None:
        with lock:
            outcomes[kind] += 1
            if detail:
                unexpected.append(detail)

    def one_request(client: Client, index: int, turn: int) -> None:
        seed = index * 100 + turn
        job = client.submit(f"client {index} turn {turn}", "64x64", 4, seed, api_name="/generate")
        try:
            _path, info = job.result(timeout=HANG_S)
        except QueueError as exc:
            if str(exc) == "Queue is full! Please try again.":
                record("queue_full")
            else:
                record("other", f"{type(exc)!r} {type(exc).__mro__} {str(exc)!r} {exc.args!r}")
        except TimeoutError:
            record("hung", f"client {index} turn {turn} timed out")
        except Exception as exc:
            record("other", f"client {index} turn {turn}: {exc!r}")
        else:
            ok = info["seed"] == seed and info["compiled"] is False
            record("ok" if ok else "other", "" if ok else f"wrong answer {info}")

    def one_client(index: int) -> None:
        try:  # a thread that dies (the barrier broken, a client error) is recorded, so the test fails naming it
            barrier.wait(timeout=HANG_S)
            for turn in range(PER_CLIENT):
                one_request(clients[index], index, turn)
        except BaseException:
            record("died", f"client {index} died: {traceback.format_exc(limit=3)}")

    status_answers: list[tuple[int, dict[str, Any]]] = []  # (requests not yet ended, the device stage) per answer
    client_status: Counter[str] = Counter()  # the same endpoint through gradio_client (Gradio's queue)
    status_errors: list[str] = []
    stop = threading.Event()
    status_client = Client(busy_app.url, verbose=False, httpx_kwargs=PATIENT_HTTP)

    def poll_status() -> None:  # until the load ended and Gradio's queue answered it once (it may refuse throughout)
        while not (stop.is_set() and client_status["answered"]):
            try:
                reply = httpx.post(f"{busy_app.url}gradio_api/run/status", json={"data": []}, timeout=HANG_S)
                status = reply.json()["data"][0]
            except Exception as exc:
                status_errors.append(f"run/status: {exc!r}")
            else:
                with lock:
                    status_answers.append((CLIENTS * PER_CLIENT - sum(outcomes.values()), status["stages"]["device"]))
                if status["shapes"]["64x64"]["state"] != "ready":
                    status_errors.append(f"64x64 is {status['shapes']['64x64']['state']}")
            try:
                ready = httpx.get(f"{busy_app.url}readyz", timeout=HANG_S)
                if ready.status_code != 200:
                    status_errors.append(f"readyz: {ready.status_code} {ready.text[:200]}")
            except Exception as exc:
                status_errors.append(f"readyz: {exc!r}")
            try:
                status_client.submit(api_name="/status").result(timeout=HANG_S)
                client_status["answered"] += 1
            except QueueError:
                client_status["queue_full"] += 1
            except Exception as exc:
                status_errors.append(f"client /status: {exc!r}")
            stop.wait(0.2)

    workers = [threading.Thread(target=one_client, args=(i,), daemon=True) for i in range(CLIENTS)]
    poller = threading.Thread(target=poll_status, daemon=True)
    for worker in workers:
        worker.start()
    poller.start()
    barrier.wait(timeout=HANG_S)
    for worker in workers:
        worker.join(timeout=HANG_S)
    stop.set()
    poller.join(timeout=HANG_S)

    during = [device for left, device in status_answers if left]  # answered while requests had not ended
    print(
        f"load: {dict(outcomes)}; status via run/status {len(status_answers)} answers ({len(during)} during the "
        f"load, {sum(d['running'] for d in during)} with a request on the device), via gradio_client "
        f"{dict(client_status)}"
    )
    assert not any(w.is_alive() for w in workers) and not poller.is_alive(), f"still running: {outcomes}"
    assert not unexpected, unexpected[:5]
    assert sum(outcomes.values()) == CLIENTS * PER_CLIENT, outcomes
    assert set(outcomes) <= {"ok", "queue_full"}, outcomes
    assert outcomes["ok"] >= QUEUE_MAX_SIZE  # the waiting room was used, not just refused
    assert busy_app.manager.counter.graphs == graphs_before
    # The status endpoint answered during the load through its unqueued HTTP route (it never waits behind it).
    # Through gradio_client it goes through Gradio's queue, whose size check counts every waiting event: it answers
    # or is refused as "queue full" like the rest, and never hangs.
    assert not status_errors, status_errors[:5]
    assert during, status_answers[:5]
    assert client_status["answered"] >= 1, client_status
    hits = Client(busy_app.url, verbose=False, httpx_kwargs=PATIENT_HTTP).predict(api_name="/status")["shapes"][
        "64x64"
    ]["hits"]
    assert hits == outcomes["ok"] + 1  # + the warm-up: every success was served, nothing ran twice
