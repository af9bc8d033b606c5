"""Load: many clients at once against a small queue, on 127.0.0.1 only, bounded in time.

32 gradio_client clients (threads) send 3 requests each to a ready shape of the tiny app whose queue
holds 8. Every request must end in one of two ways, a result or Gradio's clear queue-full answer;
none may hang or vanish, and the status endpoint must keep answering while the device is busy.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from gradio_client import Client
from gradio_client.utils import QueueError

CLIENTS, PER_CLIENT = 32, 3
QUEUE_MAX_SIZE = 8
REQUEST_TIMEOUT_S = 60.0
TEST_BUDGET_S = 90.0


@pytest.fixture(scope="module")
def busy_app(launch_tiny: Callable[..., Any]) -> Any:
    """The tiny app with a waiting room of 8 and one device lane, 64x64 already compiled."""
    app = launch_tiny(queue_max_size=QUEUE_MAX_SIZE, concurrency_limit=1)
    Client(app.url, verbose=False).predict("warm-up", "64x64", 4, 0, api_name="/generate")
    return app


def test_concurrent_clients_get_a_result_or_queue_full(busy_app: Any) -> None:
    """96 requests from 32 concurrent clients: each one either succeeds (with its own seed echoed back) or
    gets "Queue is full! Please try again."; none times out or fails otherwise, the counts add up to 96,
    nothing compiles, and the status answers throughout: always on its unqueued HTTP route
    (POST /gradio_api/run/status) and on GET /readyz, through gradio_client either an answer or queue-full,
    never a hang."""
    start = time.monotonic()
    outcomes: Counter[str] = Counter()
    unexpected: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(CLIENTS)
    graphs_before = busy_app.manager.counter.graphs

    def record(kind: str, detail: str = "") -> None:
        with lock:
            outcomes[kind] += 1
            if detail:
                unexpected.append(detail)

    def one_client(index: int) -> None:
        client = Client(busy_app.url, verbose=False)
        barrier.wait(timeout=60)
        for turn in range(PER_CLIENT):
            seed = index * 100 + turn
            job = client.submit(f"client {index} turn {turn}", "64x64", 4, seed, api_name="/generate")
            try:
                _path, info = job.result(timeout=REQUEST_TIMEOUT_S)
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

    status_answers: list[float] = []  # seconds per answer of the unqueued HTTP route
    client_status: Counter[str] = Counter()  # the same endpoint through gradio_client (Gradio's queue)
    status_errors: list[str] = []
    stop = threading.Event()

    def poll_status() -> None:
        client = Client(busy_app.url, verbose=False)
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                reply = httpx.post(f"{busy_app.url}gradio_api/run/status", json={"data": []}, timeout=10)
                state = reply.json()["data"][0]["shapes"]["64x64"]["state"]
            except Exception as exc:
                status_errors.append(f"run/status: {exc!r}")
            else:
                status_answers.append(time.monotonic() - t0)
                if state != "ready":
                    status_errors.append(f"64x64 is {state}")
            try:
                ready = httpx.get(f"{busy_app.url}readyz", timeout=10)
                if ready.status_code != 200:
                    status_errors.append(f"readyz: {ready.status_code} {ready.text[:200]}")
            except Exception as exc:
                status_errors.append(f"readyz: {exc!r}")
            try:
                client.submit(api_name="/status").result(timeout=10)
                client_status["answered"] += 1
            except QueueError:
                client_status["queue_full"] += 1
            except Exception as exc:
                status_errors.append(f"client /status: {exc!r}")
            time.sleep(0.2)

    workers = [threading.Thread(target=one_client, args=(i,), daemon=True) for i in range(CLIENTS)]
    poller = threading.Thread(target=poll_status, daemon=True)
    poller.start()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=max(1.0, TEST_BUDGET_S - (time.monotonic() - start)))
    stop.set()
    poller.join(timeout=10)
    elapsed = time.monotonic() - start

    print(
        f"load: {dict(outcomes)} in {elapsed:.1f} s; status via run/status {len(status_answers)} answers "
        f"(max {max(status_answers, default=0):.2f} s), via gradio_client {dict(client_status)}"
    )
    assert not any(w.is_alive() for w in workers), f"clients still running after {elapsed:.0f} s: {outcomes}"
    assert not unexpected, unexpected[:5]
    assert sum(outcomes.values()) == CLIENTS * PER_CLIENT, outcomes
    assert set(outcomes) <= {"ok", "queue_full"}, outcomes
    assert outcomes["ok"] >= QUEUE_MAX_SIZE  # the waiting room was used, not just refused
    assert elapsed < TEST_BUDGET_S
    assert busy_app.manager.counter.graphs == graphs_before
    # The status endpoint answered during the load, quickly, through its unqueued HTTP route. Through
    # gradio_client it goes through Gradio's queue, whose size check counts every waiting event: it
    # answers or is refused as "queue full" like the rest, and never hangs.
    assert not status_errors, status_errors[:5]
    assert len(status_answers) >= 5, status_answers
    assert max(status_answers) < 5.0, status_answers
    assert client_status["answered"] >= 1, client_status
    hits = Client(busy_app.url, verbose=False).predict(api_name="/status")["shapes"]["64x64"]["hits"]
    assert hits == outcomes["ok"] + 1  # + the warm-up: every success was served, nothing ran twice
