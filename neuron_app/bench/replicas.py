"""Bench section `replicas`: 1 vs 2 replicas (Ray Serve) on one machine, side by side in one run.

For each replica count, `python app.py` serves; every replica gets the ready shape, then:
- throughput: 8 clients (the largest --clients) hammer the ready shape; images/s;
- freeze: the ready shape's solo latency, then its latency while another request compiles a cold shape.
With 1 replica (today's in-process server) the ready request waits for the whole compile; with 2 the other
replica serves it. Ratios come from one run, so a busy machine still compares like with like.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from typing import Any

from neuron_app.bench.common import summarize

PROMPT = "a lighthouse on a cliff at dawn"
REPLICA_COUNTS = (1, 2)


def _cold_shape(ready: str, shapes: list[str]) -> str | None:
    """A configured shape with another graph than `ready` (another image-token count)."""
    from neuron_app.shapes import Resolution

    tokens = Resolution.parse(ready).image_tokens
    return next((s for s in shapes if Resolution.parse(s).image_tokens != tokens), None)


def section_replicas(harness: Any) -> dict[str, Any]:
    from neuron_app.bench.harness import free_port, settings_env

    cfg = harness.cfg
    ready = cfg.shapes[0]
    cold = _cold_shape(ready, cfg.all_shapes)
    if cold is None:
        raise RuntimeError("the replicas section needs two shapes with different token counts (--recompile-shapes)")
    clients = max(cfg.clients, default=1)
    rows = []
    counts = REPLICA_COUNTS[1:] if cfg.smoke else REPLICA_COUNTS  # smoke: the Ray path only (the rest is costly)
    for count in counts:
        cache_dir = harness.new_cache(f"replicas-{count}")
        port = free_port()
        settings = harness.settings(
            cfg.serving_mode,
            cache_dir,
            server_port=port,
            server_name="127.0.0.1",
            share=False,
            replicas=count,
            queue_max_size=max(16, 2 * clients),
            resolutions=[ready, cold],
            default_resolution=ready,
        )
        env = harness._env() | settings_env(settings)
        url = f"http://127.0.0.1:{port}/"
        start = time.perf_counter()
        proc, log_path = harness._popen([sys.executable, "app.py"], f"replicas-{count}", env=env)
        try:
            rows.append(_measure(harness, proc, url, count, ready, cold, clients, start))
        except Exception as exc:
            from neuron_app.bench.harness import BenchError, _log_tail

            raise BenchError(f"replicas={count}: {exc}; log {log_path}: {_log_tail(log_path)}") from None
        finally:
            _stop(proc)
        harness.log(
            f"replicas {count}: {rows[-1]['images_per_s']:.2f} images/s with {clients} clients; ready shape "
            f"{rows[-1]['during_compile_s']:.2f} s during a cold compile vs {rows[-1]['solo']['median_s']:.2f} s solo"
        )
    by_count = {row["replicas"]: row for row in rows}
    one, two = by_count.get(1), by_count[2]
    return {
        "ready_shape": ready,
        "cold_shape": cold,
        "steps": cfg.steps,
        "clients": clients,
        "per_client": cfg.per_client,
        "mode": cfg.serving_mode,
        "rows": rows,
        "throughput_ratio_2_vs_1": two["images_per_s"] / one["images_per_s"] if one and one["images_per_s"] else None,
    }


def _stop(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM to app.py alone (it drains, stops its replicas and its Ray instance), then the group if it hangs."""
    import os
    import signal

    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own group (started with start_new_session), by id
        proc.wait(timeout=30)


def _measure(
    harness: Any, proc: subprocess.Popen[Any], url: str, count: int, ready: str, cold: str, clients: int, start: float
) -> dict[str, Any]:
    from neuron_app.bench.harness import BenchError, _http_ok

    deadline = time.monotonic() + harness.cfg.timeout_s
    while not _http_ok(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise BenchError(f"app.py with {count} replica(s) did not come up (exit {proc.poll()})")
        time.sleep(0.1)
    up_s = time.perf_counter() - start
    steps = harness.cfg.steps
    client = harness.client(url)
    # Make the ready shape ready on every replica: `count` concurrent first requests (one compile, disk loads).
    jobs = [client.submit(PROMPT, ready, steps, seed, api_name="/generate") for seed in range(count)]
    for job in jobs:
        job.result(timeout=harness.cfg.timeout_s)
    throughput = harness._run_clients(url, clients, ready, steps)
    solo = []
    for seed in range(1, 6):
        t0 = time.perf_counter()
        client.predict(PROMPT, ready, steps, seed, api_name="/generate")
        solo.append(time.perf_counter() - t0)
    compiler = harness.client(url)
    cold_job = compiler.submit(PROMPT, cold, steps, 0, api_name="/generate")
    while client.predict(api_name="/status")["shapes"][cold]["state"] == "not_compiled" and not cold_job.done():
        time.sleep(0.05)
    t0 = time.perf_counter()
    _path, info = client.predict(PROMPT, ready, steps, 99, api_name="/generate")
    during = time.perf_counter() - t0
    overlapped = not cold_job.done()
    _cold_path, cold_info = cold_job.result(timeout=harness.cfg.timeout_s)
    status = client.predict(api_name="/status")
    solo_summary = summarize(solo)
    return {
        "replicas": count,
        "page_up_s": up_s,
        "images_per_s": throughput["images_per_s"],
        "throughput": throughput,
        "solo": solo_summary,
        "during_compile_s": during,
        "during_vs_solo": during / statistics.median(solo),
        "overlapped_compile": overlapped,
        "cold_compile_s": cold_info.get("compile_s"),
        "served_by": info.get("replica"),
        "cold_served_by": cold_info.get("replica"),
        "healthy_replicas": sum(1 for r in status.get("replicas", []) if r["healthy"]) or 1,
    }


def replicas_md(results: dict[str, Any]) -> str:
    from neuron_app.bench.report import _failed, _num, _s, _table

    sec = results["sections"].get("replicas")
    if (why := _failed(sec)) is not None:
        return why
    rows = [
        [
            r["replicas"],
            _num(r["images_per_s"], 2),
            f"{r['throughput']['ok']}/{r['throughput']['sent']}",
            _s(r["solo"]["median_s"]),
            _s(r["during_compile_s"]),
            _num(r["during_vs_solo"], 1) + "x",
            "yes" if r["overlapped_compile"] else "no",
            _s(r["cold_compile_s"]),
        ]
        for r in sec["rows"]
    ]
    ratio = sec.get("throughput_ratio_2_vs_1")
    return (
        f"`python app.py` with `NEURON_APP_REPLICAS=1` (in-process) and `=2` (Ray Serve, one torch thread each); "
        f"ready shape {sec['ready_shape']}, cold shape {sec['cold_shape']}, {sec['steps']} steps, mode {sec['mode']}, "
        f"{sec['clients']} clients x {sec['per_client']} requests."
        + (f" 2 replicas give **{_num(ratio, 2)}x** the images/s of 1." if ratio is not None else "")
        + "\n\n"
        + _table(
            [
                "replicas",
                "images/s",
                "ok",
                "ready solo s",
                "ready during a cold compile s",
                "during / solo",
                "compile still running",
                "cold compile s",
            ],
            rows,
        )
    )
