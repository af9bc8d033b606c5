"""Bench section `serving`: what the server adds to a generation, timed on the manager and through the app, interleaved.

The serving worker (`serve`) runs the real app on a ready shape; the concurrency section shares it.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from neuron_app.bench import markdown as md
from neuron_app.bench.common import (
    PROMPT,
    RESULT_TAG,
    BenchError,
    emit,
    facts,
    good_result,
    loaded_manager,
    seconds,
    summarize,
    timed_generate,
    worker_settings,
)
from neuron_app.bench.process import Lines

KIND = "serve"
TITLE = "4. Serving overhead"
#: The serving worker announces that the app answers with this prefix, then waits for "quit".
READY_TAG = "BENCH_READY "
#: The serving worker's answer to "direct SEED": one generation timed on the manager, in the server process.
DIRECT_TAG = "BENCH_DIRECT "


@contextlib.contextmanager
def server(harness: Any) -> Iterator[dict[str, Any]]:
    """The serving worker, up and answering; yields its ready message, then its final answer."""
    cache_dir, cache_note = harness.cache_for("serve", fresh=harness.parallel)
    served, _url = harness.served()
    settings = served | {"concurrency_limit": 1, "queue_max_size": max(16, 2 * max(harness.cfg.clients, default=1))}
    spec = harness.spec("serve", cache_dir, None, settings, shape=harness.cfg.shapes[0])
    info: dict[str, Any] = {"cache_folder": cache_note}
    with harness.process(
        harness.worker_args(spec), "serve", None, {"exit_s": 10.0}, stdout=subprocess.PIPE, stdin=subprocess.PIPE
    ) as (proc, _log):
        lines = Lines(proc.stdout)
        ready = lines.wait_for(READY_TAG, time.monotonic() + harness.cfg.timeout_s)
        if "error" in ready:
            raise BenchError(ready["error"])
        info.update(ready)
        harness.note_resolved(ready)

        def direct(seed: int) -> float:
            proc.stdin.write(f"direct {seed}\n")
            proc.stdin.flush()
            return lines.wait_for(DIRECT_TAG, time.monotonic() + harness.cfg.timeout_s)["s"]

        info["direct"] = direct
        yield info
        proc.stdin.write("quit\n")
        proc.stdin.flush()
        final = lines.wait_for(RESULT_TAG, time.monotonic() + 120)
        if "error" in final:
            raise BenchError(final["error"])
        info["final"] = final


def section(harness: Any, server: dict[str, Any]) -> dict[str, Any]:
    """The same ready shape on the manager, through gradio_client and on the wire (`WireClient`, no 50 ms poll),
    interleaved, each beside `/floor`; on the wire the floor sleeps as long as the generate before it took in the
    manager (`total_s`): generate minus that matched floor is what serving an image adds."""
    from neuron_app.bench.wire import WireClient

    shape, steps = harness.cfg.shapes[0], harness.cfg.steps
    client, wire = harness.client(server["url"]), WireClient(server["url"])
    client.predict(PROMPT, shape, steps, 0, api_name="/generate")  # warm the connection and the queue
    wire.call("generate", PROMPT, shape, steps, 0, "none", 1.0, None, download=True)
    via_app, direct, floor, bad = [], [], [], 0
    wire_generate, wire_floor, wire_matched = [], [], []
    client.predict(0, api_name="/floor")
    for seed in range(1, harness.cfg.repeats + 1):
        start = time.perf_counter()
        client.predict(0, api_name="/floor")
        floor.append(time.perf_counter() - start)
        direct.append(server["direct"](seed))
        start = time.perf_counter()
        path, info = client.predict(PROMPT, shape, steps, seed, api_name="/generate")
        via_app.append(time.perf_counter() - start)
        bad += not good_result(path, info, shape, seed)
        wire_floor.append(wire.call("floor", 0)[0])
        took, (_image, wire_info) = wire.call("generate", PROMPT, shape, steps, seed, "none", 1.0, None, download=True)
        wire_generate.append(took)
        bad += not (wire_info.get("seed") == seed and wire_info.get("resolution") == shape)
        wire_matched.append(wire.call("floor", 1000 * float(wire_info["total_s"]))[0])
    wire.close()
    client.predict(api_name="/status")
    status = seconds(lambda _: client.predict(api_name="/status"), range(max(harness.cfg.repeats, 10)))
    direct, app = summarize(direct), summarize(via_app)
    on_wire = {"generate": summarize(wire_generate), "floor": summarize(wire_floor)}
    on_wire["matched_floor"] = summarize(wire_matched)
    result = {"shape": shape, "steps": steps, **{key: server[key] for key in ("mode", "backend", "cache_folder")}}
    result |= {"server_compile": server["compile"], "direct": direct, "via_app": app}
    result |= {"status_rtt": summarize(status), "floor_rtt": summarize(floor), "wire": on_wire}
    # what serving an image adds to a text endpoint whose handler takes as long, with no client polling
    result["wire_above_matched_floor_ms"] = 1000 * (
        on_wire["generate"]["median_s"] - on_wire["matched_floor"]["median_s"]
    )
    result["overhead_above_floor_ms"] = 1000 * (app["median_s"] - direct["median_s"] - summarize(floor)["median_s"])
    result["overhead_median_ms"] = 1000 * (app["median_s"] - direct["median_s"])
    return result | {"overhead_p95_ms": 1000 * (app["p95_s"] - direct["p95_s"]), "bad_results": bad}


def _add_floor_endpoint(demo: Any) -> None:
    """`/floor`: a queued text endpoint on the same server, what any Gradio request costs here; it sleeps the
    milliseconds it is given (in Gradio's worker thread, as `generate` runs), to match a generate's handler."""
    import gradio as gr

    def floor(ms: float | None = 0.0) -> str:
        time.sleep(max(0.0, float(ms or 0.0)) / 1000.0)
        return "ok"

    with demo:
        button, out, ms = gr.Button(visible=False), gr.Textbox(visible=False), gr.Number(value=0, visible=False)
        button.click(floor, inputs=[ms], outputs=[out], api_name="floor", concurrency_limit=None)


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """The real app on a ready shape, driven from the orchestrator's process as a real client would; on a "direct
    SEED" line, one `generate()` timed on the manager here, so direct and served calls interleave on the same
    machine. "quit" ends it (the answer carries this process's peak memory)."""
    from neuron_app.web.server import build_app, launch, prepare_environment

    settings = worker_settings(spec)
    prepare_environment(settings)  # gradio's temp folder, before gradio is imported
    manager = loaded_manager(settings)
    shape, steps = spec["shape"], spec["steps"]
    outcome = manager.compile_shape(shape)
    timed_generate(manager, shape, steps, 0)  # warm: the first call after a compile can be slower
    app = build_app(settings, manager)
    _add_floor_endpoint(app.demo)
    launch(app, block=False, quiet=True)
    graphs_ready = manager.counter.graphs
    compiled = {"compile_s": outcome.compile_s, "graphs": outcome.graphs, "cache": str(outcome.cache)}
    emit(READY_TAG, facts(manager) | {"url": f"http://127.0.0.1:{settings.server_port}/", "compile": compiled})
    for line in sys.stdin:
        command = line.split()
        if command[:1] == ["quit"]:
            break
        if command[:1] == ["direct"]:
            emit(DIRECT_TAG, {"s": timed_generate(manager, shape, steps, int(command[1]))[0]})
    status = manager.status()
    app.demo.close()
    return {
        "graphs_while_serving": manager.counter.graphs - graphs_ready,  # must be 0: the shape was ready
        "hits": status.shapes[shape].hits,
    }


def render(sec: dict[str, Any]) -> str:
    def timed(label: str, summary: dict[str, Any]) -> list[Any]:
        return [label, md.ms(summary["median_s"]), md.ms(summary["p95_s"]), summary["n"]]

    def difference(label: str, median_ms: float, p95_ms: float | None = None) -> list[Any]:
        return [label, md.num(median_ms, 1), "" if p95_ms is None else md.num(p95_ms, 1), ""]

    rows = [
        timed("manager.generate() in the server process", sec["direct"]),
        timed("gradio_client `/generate` (another process)", sec["via_app"]),
        difference("**difference (serving overhead)**", sec["overhead_median_ms"], sec["overhead_p95_ms"]),
        timed("gradio_client `/status` round trip (no queue)", sec["status_rtt"]),
    ]
    if "floor_rtt" in sec:  # a queued endpoint that does nothing, interleaved with the calls above
        rows.append(timed("gradio_client `/floor` round trip (queued, trivial: the floor)", sec["floor_rtt"]))
        rows.append(difference("overhead above the trivial floor (difference - floor)", sec["overhead_above_floor_ms"]))
    note = ""
    if "wire" in sec:  # the same calls without gradio_client's 50 ms message poll
        w = sec["wire"]
        rows.append(timed("on the wire: `/generate` (image downloaded)", w["generate"]))
        rows.append(timed("on the wire: `/floor` (trivial)", w["floor"]))
        rows.append(timed("on the wire: `/floor` sleeping generate's `total_s` (matched floor)", w["matched_floor"]))
        above = sec["wire_above_matched_floor_ms"]
        rows.append(difference("**on the wire: generate above the matched floor**", above))
        note = (
            "\n\ngradio_client reads its message queue every 50 ms (`stream_sse_v1plus` in `gradio_client/utils.py`), "
            "so its round trips grow in 50 ms steps with the handler's duration. The wire rows speak Gradio's queue "
            "protocol directly (`neuron_app/bench/wire.py`: join, then read the event stream as it arrives); there "
            "the matched floor is the text endpoint sleeping as long as the generate before it took in the manager, "
            "so generate minus it is what serving an image adds (the PNG save, the image output, progress events, "
            "the download)."
        )
    return (
        f"Shape {sec['shape']}, {sec['steps']} steps, mode {sec['mode']} / {sec['backend']}, "
        f"cache folder {sec['cache_folder']}.\n\n" + md.table(["path", "median ms", "p95 ms", "n"], rows) + note
    )
