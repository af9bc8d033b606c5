"""Bench section `replicas`: 1 vs 2 replicas (Ray Serve) on one machine, side by side in one run.

For each replica count, `python app.py` serves; every replica gets the ready shape, then:
- throughput: 8 clients (the largest --clients) hammer the ready shape; images/s;
- freeze: the ready shape's solo latency, then its latency while another request compiles a cold shape.
With 1 replica (today's in-process server) the ready request waits for the whole compile; with 2 the other
replica serves it. Ratios come from one run, so a busy machine still compares like with like.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from neuron_app.bench import markdown as md
from neuron_app.bench.common import CpuMeter, seconds, summarize
from neuron_app.bench.process import wait_up
from neuron_app.bench.sections.serving.concurrency import run_clients

PROMPT = "a lighthouse on a cliff at dawn"
TITLE = "9. Replicas (Ray Serve)"
REPLICA_COUNTS = (1, 2)
#: Requests each client sends per throughput run: enough that start and end effects stay small.
REQUESTS_PER_CLIENT = 6


def section(harness: Any) -> dict[str, Any]:
    from neuron_app.shapes import Resolution

    cfg = harness.cfg
    ready = cfg.replicas_shape or cfg.shapes[0]
    tokens = Resolution.parse(ready).image_tokens
    others = [s for s in cfg.all_shapes if Resolution.parse(s).image_tokens != tokens]  # another graph than ready's
    # The first configured shape, when its graph differs: it is the cold compile, then the small-image throughput.
    small = cfg.shapes[0] if cfg.shapes[0] in others else None
    cold = small or next(iter(others), None)
    if cold is None:
        raise RuntimeError("the replicas section needs two shapes with different token counts (--recompile-shapes)")
    clients = max(cfg.clients, default=1)
    rows = []
    counts = REPLICA_COUNTS[1:] if cfg.smoke else REPLICA_COUNTS  # smoke: the Ray path only (the rest is costly)
    for count in counts:
        settings = {"replicas": count, "queue_max_size": max(16, 2 * clients)}
        settings |= {"resolutions": [ready, cold], "default_resolution": ready}
        start = time.perf_counter()
        # SIGTERM to app.py alone: it drains, stops its replicas and its Ray instance; the group is killed if it hangs
        stop = {"leader_only": True, "grace_s": 90.0}
        with harness.app(f"replicas-{count}", harness.new_cache(f"replicas-{count}"), stop, **settings) as (proc, url):
            wait_up(url, proc, time.monotonic() + cfg.timeout_s)
            rows.append(_measure(harness, url, count, ready, cold, small, clients, time.perf_counter() - start))
        harness.log(
            f"replicas {count}: {rows[-1]['images_per_s']:.2f} images/s with {clients} clients; ready shape "
            f"{rows[-1]['during_compile_s']:.2f} s during a cold compile vs {rows[-1]['solo']['median_s']:.2f} s solo"
        )
    by_count = {row["replicas"]: row for row in rows}
    one, two = by_count.get(1), by_count[2]

    def ratio(key: str) -> float | None:
        if not one or not one.get(key) or not two.get(key):
            return None
        return two[key]["images_per_s"] / one[key]["images_per_s"]

    return {
        "ready_shape": ready,
        "cold_shape": cold,
        "small_shape": small,
        "steps": cfg.steps,
        "clients": clients,
        "per_client": cfg.per_client if cfg.smoke else REQUESTS_PER_CLIENT,
        "mode": cfg.serving_mode,
        "rows": rows,
        "throughput_ratio_2_vs_1": ratio("throughput"),
        "small_ratio_2_vs_1": ratio("small_throughput"),
    }


def _throughput(harness: Any, url: str, clients: int, shape: str) -> dict[str, Any]:
    """`clients` gradio_client clients on one ready shape, with where the machine's CPU went meanwhile."""
    meter = CpuMeter()
    per_client = harness.cfg.per_client if harness.cfg.smoke else REQUESTS_PER_CLIENT
    row = run_clients(harness, url, clients, shape, harness.cfg.steps, per_client=per_client)
    _wall, busy, own = meter.elapsed()
    images = max(1, row["ok"])
    row["server_cpu_ms_per_image"] = 1000 * max(0.0, busy - own) / images  # app.py, Ray and the replicas
    row["client_cpu_ms_per_image"] = 1000 * own / images  # the bench's gradio_client threads
    row["cpu_busy"] = busy / (row["wall_s"] * (os.cpu_count() or 1)) if row["wall_s"] else None
    return row


def _ready_everywhere(client: Any, shape: str, steps: int, count: int, timeout_s: float) -> None:
    """`count` concurrent first requests: one compile (or a ready graph), disk loads on the other replicas."""
    jobs = [client.submit(PROMPT, shape, steps, seed, api_name="/generate") for seed in range(count)]
    for job in jobs:
        job.result(timeout=timeout_s)


def _measure(
    harness: Any, url: str, count: int, ready: str, cold: str, small: str | None, clients: int, up_s: float
) -> dict[str, Any]:
    steps, timeout_s = harness.cfg.steps, harness.cfg.timeout_s
    client = harness.client(url)
    _ready_everywhere(client, ready, steps, count, timeout_s)
    throughput = _throughput(harness, url, clients, ready)
    solo = seconds(lambda seed: client.predict(PROMPT, ready, steps, seed, api_name="/generate"), range(1, 6))
    compiler = harness.client(url)
    cold_job = compiler.submit(PROMPT, cold, steps, 0, api_name="/generate")
    while client.predict(api_name="/status")["shapes"][cold]["state"] == "not_compiled" and not cold_job.done():
        time.sleep(0.05)
    t0 = time.perf_counter()
    _path, info = client.predict(PROMPT, ready, steps, 99, api_name="/generate")
    during = time.perf_counter() - t0
    overlapped = not cold_job.done()
    _cold_path, cold_info = cold_job.result(timeout=timeout_s)
    small_throughput = None
    if small is not None:  # compiled just now: ready it on every replica, then the small-image throughput
        _ready_everywhere(client, small, steps, count, timeout_s)
        small_throughput = _throughput(harness, url, clients, small)
    status = client.predict(api_name="/status")
    row = {"replicas": count, "page_up_s": up_s, "images_per_s": throughput["images_per_s"], "throughput": throughput}
    row |= {"small_throughput": small_throughput, "solo": summarize(solo), "during_compile_s": during}
    row |= {"during_vs_solo": during / statistics.median(solo), "overlapped_compile": overlapped}
    row |= {"cold_compile_s": cold_info.get("compile_s"), "served_by": info.get("replica")}
    healthy = sum(1 for r in status.get("replicas", []) if r["healthy"]) or 1
    return row | {"cold_served_by": cold_info.get("replica"), "healthy_replicas": healthy}


def render(sec: dict[str, Any]) -> str:

    def rate(row: dict[str, Any] | None) -> list[str]:
        return [md.num(row["images_per_s"], 2), f"{row['ok']}/{row['sent']}"] if row else ["-", "-"]

    rows = []
    for r in sec["rows"]:
        load = r["throughput"]
        cpu = [md.num(load.get("server_cpu_ms_per_image"), 0), md.num(load.get("client_cpu_ms_per_image"), 0)]
        small_cells = rate(r.get("small_throughput")) if sec.get("small_shape") else []
        freeze = [
            md.s(r["solo"]["median_s"]),
            md.s(r["during_compile_s"]),
            md.num(r["during_vs_solo"], 1) + "x",
            "yes" if r["overlapped_compile"] else "no",
            md.s(r["cold_compile_s"]),
        ]
        rows.append([r["replicas"], *rate(load), *cpu, *small_cells, *freeze])
    ready, small = sec["ready_shape"], sec.get("small_shape")
    head = ["replicas", f"{ready} images/s", "ok", "server CPU ms/image", "client CPU ms/image"]
    head += [f"{small} images/s", "ok"] if small else []
    head += [f"{ready} solo s", "during a cold compile s", "during / solo", "compile still running", "cold compile s"]
    ratio, small_ratio = sec.get("throughput_ratio_2_vs_1"), sec.get("small_ratio_2_vs_1")
    text = (
        f"`python app.py` with `NEURON_APP_REPLICAS=1` (in-process) and `=2` (Ray Serve); one torch thread per "
        f"replica; {sec['steps']} steps, mode {sec['mode']}, {sec['clients']} gradio_client clients x "
        f"{sec['per_client']} requests; cold shape {sec['cold_shape']}."
    )
    if ratio is not None:
        text += f" On {ready}, 2 replicas give **{md.num(ratio, 2)}x** the images/s of 1"
        text += f"; on {small}, {md.num(small_ratio, 2)}x." if small_ratio is not None else "."
    text += (
        " CPU per image is the machine's busy time over the run: the server side (app.py, Ray, the replicas) "
        "and the bench's own clients, all on this machine's cores. Each request costs the front end and Ray a "
        "fixed amount of CPU; where an image's compute is not well above it (the small shape), the replicas "
        "wait on that and not on each other."
    )
    return text + "\n\n" + md.table(head, rows)
