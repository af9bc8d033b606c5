"""What runs inside one benchmark subprocess: a fresh interpreter, so dynamo and the caches start clean.

Invoked as `python -m neuron_app.bench _worker '<json spec>'`. The spec names the kind of
measurement and the settings overrides; the answer is one `BENCH_RESULT {json}` line.
Everything goes through the project's public API (`PipelineManager`, `build_app`, `launch`).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from neuron_app.bench.common import (
    DIRECT_TAG,
    OTHER_PROMPT,
    PROMPT,
    READY_TAG,
    RESULT_TAG,
    cpu_seconds,
    emit,
    peak_rss_mb,
    since_process_start,
    summarize,
)
from neuron_app.bench.sections import lora
from neuron_app.shapes import Resolution


def _settings(spec: dict[str, Any]) -> Any:
    """The measured settings, with the Neuron environment exported before anything imports torch."""
    from neuron_app.environment import prepare_process
    from neuron_app.settings import load_settings

    settings = load_settings(**spec["settings"])
    prepare_process(settings)
    return settings


def _manager(spec: dict[str, Any]) -> Any:
    from neuron_app.engine.manager import PipelineManager

    return PipelineManager(_settings(spec))


def _timed_generate(manager: Any, shape: str, steps: int, seed: int, prompt: str = PROMPT) -> tuple[float, Any]:
    start = time.perf_counter()
    record = manager.generate(prompt, shape, steps, seed)
    return time.perf_counter() - start, record


def prepare(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the tiny model once, so that no measured process pays for building it."""
    from pathlib import Path

    from neuron_app.engine.tiny import ensure_tiny

    folder = ensure_tiny(Path(spec["models_dir"]), spec["variant"])
    return {"folder": str(folder)}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Per shape: cold compile (compile_shape), the first image, then the steady latency of N calls."""
    steps, repeats = spec["steps"], spec["repeats"]
    manager = _manager(spec)
    manager.ensure_loaded()
    loaded_at = since_process_start()
    shapes: dict[str, Any] = {}
    first_image_at: float | None = None
    for shape in spec["shapes"]:
        outcome = manager.compile_shape(shape)
        first_s, first = _timed_generate(manager, shape, steps, 0)
        if first_image_at is None:
            first_image_at = since_process_start()
        graphs_before = manager.counter.graphs
        latencies = [_timed_generate(manager, shape, steps, seed)[0] for seed in range(1, repeats + 1)]
        shapes[shape] = {
            "compile_s": outcome.compile_s,
            "graphs": outcome.graphs,
            "compiled": outcome.compiled,
            "cache": str(outcome.cache),
            "first_generate_s": first_s,
            "first_image_s": outcome.compile_s + first_s,
            "first_generate_graphs": first.graphs_compiled,
            "steady": summarize(latencies),
            "steady_graphs": manager.counter.graphs - graphs_before,  # must be 0: no recompile on seed
        }
    status = manager.status()
    return {
        "mode": status.compile_mode,
        "backend": status.compile_backend,
        "device": status.device,
        "dtype": status.dtype,
        "load_s": status.load_s,
        "loaded_at_s": loaded_at,
        "first_image_at_s": first_image_at,
        "graphs_total": manager.counter.graphs,
        "compile_failures": manager.counter.failures,
        "shapes": shapes,
        "peak_rss_mb": peak_rss_mb(),
    }


def sequence(spec: dict[str, Any]) -> dict[str, Any]:
    """The scripted request sequence; each distinct graph shape must compile exactly once."""
    from neuron_app.shapes import Resolution

    a, b, steps = spec["shape_a"], spec["shape_b"], spec["steps"]
    calls = [
        ("A", a, steps, 0, PROMPT),
        ("A again", a, steps, 0, PROMPT),
        ("B", b, steps, 0, PROMPT),
        ("A, other steps", a, steps + 1, 0, PROMPT),
        ("A, other seed", a, steps, 1, PROMPT),
        ("B, other prompt", b, steps, 0, OTHER_PROMPT),
    ]
    manager = _manager(spec)
    manager.ensure_loaded()
    rows = []
    for label, shape, call_steps, seed, prompt in calls:
        before = manager.counter.graphs
        elapsed, record = _timed_generate(manager, shape, call_steps, seed, prompt)
        rows.append(
            {
                "call": label,
                "shape": shape,
                "steps": call_steps,
                "seed": seed,
                "prompt": "other" if prompt == OTHER_PROMPT else "same",
                "compiled": record.compiled,
                "graphs_compiled": record.graphs_compiled,
                "graphs_counted": manager.counter.graphs - before,  # the backend's own count, any phase
                "cache": str(record.cache),
                "total_s": elapsed,
            }
        )
    keys = {manager.graph_key(Resolution.parse(s)) for s in (a, b)}
    return {
        "mode": manager.settings.compile_mode,
        "backend": manager.compile_backend,
        "device": manager.backend.name,
        "dtype": manager.dtype_name,
        "calls": rows,
        "distinct_shapes": len({a, b}),
        "distinct_graph_keys": len(keys),
        "compile_events": sum(1 for r in rows if r["compiled"]),
        "graphs_total": manager.counter.graphs,
        "compile_failures": manager.counter.failures,
        "peak_rss_mb": peak_rss_mb(),
    }


def _add_floor_endpoint(demo: Any) -> None:
    """`/floor`: a queued endpoint with a text answer, on the same server: what any Gradio request costs here.

    It sleeps the milliseconds it is given, in Gradio's worker thread as `generate` runs. gradio_client reads its
    message queue every 50 ms, so a round trip grows in steps with the handler's duration: a floor that does
    nothing is one step below a generate whose handler takes 40 ms, and compares badly with it.
    """
    import gradio as gr

    def floor(ms: float | None = 0.0) -> str:
        time.sleep(max(0.0, float(ms or 0.0)) / 1000.0)
        return "ok"

    with demo:
        button, out, ms = gr.Button(visible=False), gr.Textbox(visible=False), gr.Number(value=0, visible=False)
        button.click(floor, inputs=[ms], outputs=[out], api_name="floor", concurrency_limit=None)


def serve(spec: dict[str, Any]) -> dict[str, Any]:
    """The real app on a ready shape, for outside clients; direct manager calls on request.

    The orchestrator drives the app from its own process (as a real client would) and, on
    "direct SEED" lines, has this process time one `generate()` on the manager itself, so
    direct and served calls interleave and see the same machine. "quit" ends it; the answer
    then carries this server process's peak memory.
    """
    from neuron_app.web.server import build_app, launch, prepare_environment

    settings = _settings(spec)
    prepare_environment(settings)  # gradio's temp folder, before gradio is imported
    from neuron_app.engine.manager import PipelineManager

    manager = PipelineManager(settings)
    manager.ensure_loaded()
    shape, steps = spec["shape"], spec["steps"]
    outcome = manager.compile_shape(shape)
    _timed_generate(manager, shape, steps, 0)  # warm: the first call after a compile can be slower
    app = build_app(settings, manager)
    _add_floor_endpoint(app.demo)
    launch(app, block=False, quiet=True)
    graphs_ready = manager.counter.graphs
    emit(
        READY_TAG,
        {
            "url": f"http://127.0.0.1:{settings.server_port}/",
            "compile": {"compile_s": outcome.compile_s, "graphs": outcome.graphs, "cache": str(outcome.cache)},
            "mode": settings.compile_mode,
            "backend": manager.compile_backend,
            "device": manager.backend.name,
            "dtype": manager.dtype_name,
        },
    )
    for line in sys.stdin:
        command = line.split()
        if command[:1] == ["quit"]:
            break
        if command[:1] == ["direct"]:
            emit(DIRECT_TAG, {"s": _timed_generate(manager, shape, steps, int(command[1]))[0]})
    status = manager.status()
    app.demo.close()
    return {
        "graphs_while_serving": manager.counter.graphs - graphs_ready,  # must be 0: the shape was ready
        "hits": status.shapes[shape].hits,
        "peak_rss_mb": peak_rss_mb(),
    }


def families(spec: dict[str, Any]) -> dict[str, Any]:
    """Compile every shape on one VAE path; count transformer and VAE graphs apart. Then, on the last shape,
    the text encoder's share of a generation and what the prompt cache saves.

    Paths: `eager-vae` (today on CPU/GPU: the VAE runs eager, no graph), `whole-vae` (the VAE decoder compiled
    on the whole latent: what a static-shape compiler such as Neuron pays today, one graph per latent shape)
    and `tiled-vae` (vae_compile on: one tile graph for every shape).
    """
    manager = _manager(spec)
    pipe = manager.ensure_loaded()
    if spec["path"] == "whole-vae":
        pipe.vae.decoder.compile(backend=manager.vae_counter, fullgraph=True, dynamic=False)
    rows = []
    for shape in spec["shapes"]:
        total, vae = manager.counter.graphs, manager.vae_counter.graphs
        outcome = manager.compile_shape(shape)
        _timed_generate(manager, shape, 1, 0)  # the request itself: a shape that shares a graph compiles nothing
        rows.append(
            {
                "shape": shape,
                "tokens": Resolution.parse(shape).image_tokens,
                "transformer_graphs": (manager.counter.graphs - total) - (manager.vae_counter.graphs - vae),
                "vae_graphs": manager.vae_counter.graphs - vae,
                "compile_s": outcome.compile_s,
                "cache": str(outcome.cache),
            }
        )
    shape, steps, repeats = spec["shapes"][-1], spec["steps"], spec["repeats"]
    encode = []
    for i in range(repeats):
        start = time.perf_counter()
        pipe.encode_prompt(prompt=f"{PROMPT} {i}", max_sequence_length=manager.settings.max_sequence_length)
        encode.append(time.perf_counter() - start)
    misses = [_timed_generate(manager, shape, steps, 0, f"{OTHER_PROMPT} {i}")[0] for i in range(repeats)]
    hits = [_timed_generate(manager, shape, steps, seed, OTHER_PROMPT + " 0")[0] for seed in range(1, repeats + 1)]
    status = manager.status()
    return {
        "path": spec["path"],
        "mode": status.compile_mode,
        "backend": status.compile_backend,
        "device": status.device,
        "dtype": status.dtype,
        "rows": rows,
        "transformer_graphs": status.compiles - manager.vae_counter.graphs,
        "vae_graphs": manager.vae_counter.graphs,
        "compile_s": sum(r["compile_s"] for r in rows),
        "encode": summarize(encode),
        "generate_miss": summarize(misses),
        "generate_hit": summarize(hits),
        "prompt_cache": status.prompt_cache,
    }


def edit(spec: dict[str, Any]) -> dict[str, Any]:
    """Per reference count at one output shape: the first call (compile + image), then the steady latency.

    References are images of the output's own size, so each snaps to that bucket: n references add n times the
    output's tokens to the transformer's sequence. The compiler's one-time start-up is paid beforehand on
    another shape, so the 0-reference compile is not inflated by it."""
    from PIL import Image

    from neuron_app.shapes import Resolution

    shape, steps, repeats = spec["shape"], spec["steps"], spec["repeats"]
    res = Resolution.parse(shape)
    manager = _manager(spec)
    manager.ensure_loaded()
    if spec.get("warm_shape"):
        manager.compile_shape(spec["warm_shape"])
    rows = []
    for count in spec["references"]:
        refs = [Image.new("RGB", (res.width, res.height), (60 * i % 256, 90, 200)) for i in range(count)] or None

        def timed(seed: int, refs: Any = refs) -> tuple[float, Any]:
            start = time.perf_counter()
            record = manager.generate(PROMPT, shape, steps, seed, references=refs)
            return time.perf_counter() - start, record

        first_s, first = timed(0)
        graphs_before = manager.counter.graphs
        latencies = [timed(seed)[0] for seed in range(1, repeats + 1)]
        rows.append(
            {
                "references": count,
                "image_tokens": res.image_tokens * (count + 1),
                "graphs": first.graphs_compiled,
                "compile_s": first.compile_s,
                "first_image_s": first_s,
                "steady": summarize(latencies),
                "steady_graphs": manager.counter.graphs - graphs_before,  # must be 0
            }
        )
    return {
        "mode": manager.settings.compile_mode,
        "backend": manager.compile_backend,
        "device": manager.backend.name,
        "dtype": manager.dtype_name,
        "rows": rows,
        "peak_rss_mb": peak_rss_mb(),
    }


KINDS = {
    "prepare": prepare,
    "measure": measure,
    "sequence": sequence,
    "serve": serve,
    "lora": lora.measure,
    "families": families,
    "edit": edit,
}


def main(argv: list[str]) -> int:
    """Run one measurement; an exception becomes an `error` answer, so the run goes on."""
    spec = json.loads(argv[0])
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        result = KINDS[spec["kind"]](spec)
    except Exception as exc:
        logging.exception("worker %s failed", spec.get("kind"))
        emit(RESULT_TAG, {"error": f"{type(exc).__name__}: {str(exc).strip()[:500]}"})
        return 1
    emit(RESULT_TAG, result | {"process_s": since_process_start(), "cpu_s": cpu_seconds()})
    return 0
