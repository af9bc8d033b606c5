"""Bench section `concurrency`: K clients, each with its own connection, on one ready shape of the serving worker;
every request accounted for (ok, error or lost).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from neuron_app.bench import markdown as md
from neuron_app.bench.common import PROMPT, good_result, summarize

TITLE = "5. Concurrency"


def section(harness: Any, server: dict[str, Any]) -> dict[str, Any]:
    shape, steps = harness.cfg.shapes[0], harness.cfg.steps
    rows = []
    for k in harness.cfg.clients:
        row = run_clients(harness, server["url"], k, shape, steps)
        rows.append(row)
        harness.log(f"concurrency: {k} client(s): {row['ok']}/{row['sent']} ok in {row['wall_s']:.2f} s")
    return {"shape": shape, "steps": steps, "per_client": harness.cfg.per_client, "rows": rows}


def run_clients(
    harness: Any, url: str, k: int, shape: str, steps: int, per_client: int | None = None
) -> dict[str, Any]:
    per_client = per_client or harness.cfg.per_client
    clients = [harness.client(url) for _ in range(k)]  # connected before the clock starts
    outcomes: list[tuple[str, float]] = []
    lock = threading.Lock()
    barrier = threading.Barrier(k + 1)

    def work(index: int, client: Any) -> None:
        barrier.wait()
        for j in range(per_client):
            seed = 1000 * (index + 1) + j
            start = time.perf_counter()
            try:
                path, info = client.predict(PROMPT, shape, steps, seed, api_name="/generate")
                kind = "ok" if good_result(path, info, shape, seed) else "bad"
            except Exception:
                kind = "error"
            with lock:
                outcomes.append((kind, time.perf_counter() - start))

    threads = [threading.Thread(target=work, args=(i, c), daemon=True) for i, c in enumerate(clients)]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    deadline = time.monotonic() + harness.cfg.timeout_s
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    wall = time.perf_counter() - start
    with lock:
        done = list(outcomes)
    for client in clients:
        with contextlib.suppress(Exception):
            client.close()
    sent = k * per_client
    ok = [t for kind, t in done if kind == "ok"]
    errors = sum(1 for kind, _ in done if kind != "ok")
    lost = sent - len(ok) - errors  # neither answered nor refused before the timeout
    row = {"clients": k, "sent": sent, "ok": len(ok), "errors": errors, "lost": lost, "wall_s": wall}
    return row | {"images_per_s": len(ok) / wall if wall > 0 else None, "latency": summarize(ok)}


COLUMNS = [
    ("clients", "clients"),
    ("sent", "sent"),
    ("ok", "ok"),
    ("errors", "errors"),
    ("lost", "lost"),
    ("wall s", "wall_s", md.s),
    ("images/s", "images_per_s", md.num),
    ("median ms", "latency.median_s", md.ms),
    ("p95 ms", "latency.p95_s", md.ms),
]


def render(sec: dict[str, Any]) -> str:
    return (
        f"Shape {sec['shape']}, {sec['per_client']} request(s) per client, each client its own "
        "`gradio_client.Client` in its own thread; the server runs one generation at a time.\n\n"
        + md.columns(COLUMNS, sec["rows"])
    )
