"""python -m neuron_app.bench.studies.ops_costs: what tracing adds to a warm request, and how long a cancel takes to
free the device, in step times (tiny model, aot_eager, in process; ratios, not seconds, are what carry to other
machines).

With `--waterfall`, the example in docs/operations.md: one `openai` SDK request to the real app (a fresh cache folder,
so it compiles) with the OpenTelemetry SDK's in-memory exporter, every span of its trace drawn on one time axis,
children under their parents.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
import time
from typing import Any

from neuron_app import tracing
from neuron_app.bench import script
from neuron_app.bench.common import free_port
from neuron_app.engine.records import ProgressEvent
from neuron_app.errors import Cancelled

WIDTH = 48


def waterfall(spans: list[Any]) -> str:
    """Spans of one trace as lines `name  start ms  duration ms  bar`, depth-first from the root."""
    start = min(s.start_time for s in spans)
    total = max(s.end_time for s in spans) - start or 1
    children: dict[Any, list[Any]] = {}
    for span in spans:
        children.setdefault(span.parent.span_id if span.parent else None, []).append(span)
    lines = [f"{'span':<34} {'start':>8} {'took':>9}  timeline ({total / 1e6:.0f} ms)"]

    def walk(span: Any, depth: int) -> None:
        left = int((span.start_time - start) / total * WIDTH)
        width = max(1, int((span.end_time - span.start_time) / total * WIDTH))
        name = ("  " * depth + span.name)[:34]
        took = (span.end_time - span.start_time) / 1e6
        lines.append(f"{name:<34} {(span.start_time - start) / 1e6:>6.1f}ms {took:>7.1f}ms  {' ' * left}{'█' * width}")
        for child in sorted(children.get(span.context.span_id, []), key=lambda s: s.start_time):
            walk(child, depth + 1)

    for root in children.get(None, []):
        walk(root, 0)
    return "\n".join(lines)


def costs(args: argparse.Namespace) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    manager = script.tiny_manager([args.size], max_sequence_length=32)
    manager.generate("warm", args.size, args.steps, 0)  # load and compile

    off, on, counts = [], [], []
    for i in range(args.repeats):  # alternated: the machine's load drifts between the two alike
        pair = ((False, off), (True, on))
        for traced, times in pair if i % 2 == 0 else pair[::-1]:  # ABBA: neither is always the first of a pair
            exporter = InMemorySpanExporter()
            if traced:
                tracing.setup(None, exporter=exporter)
            start = time.perf_counter()
            manager.generate("a lighthouse", args.size, args.steps, i)
            times.append(time.perf_counter() - start)
            if traced:
                counts.append(len(exporter.get_finished_spans()))
            tracing.shutdown()
    spans = statistics.median(counts)
    off_s, on_s = statistics.median(off), statistics.median(on)
    print(
        f"warm {args.size} x{args.steps} steps: median {off_s * 1000:.1f} ms untraced, {on_s * 1000:.1f} ms traced "
        f"({spans:.0f} spans each): ratio {on_s / off_s:.3f}"
    )

    freed, steps_ms = [], []  # the ask to a free device, over the step before it in the same run (the load drifts)
    for _ in range(args.repeats):
        ends: dict[int, float] = {}

        def progress(event: ProgressEvent, ends: dict[int, float] = ends) -> None:
            if event.phase == "denoising" and 2 in ends:
                raise Cancelled("stop")  # the first step event after the ask: the call ends here
            if event.phase == "denoising":
                ends[event.step] = time.perf_counter()  # the ask comes at step 2's end

        def run(progress: object = progress) -> None:
            with contextlib.suppress(Cancelled):
                manager.generate("a lighthouse", args.size, args.steps, 0, progress=progress)

        worker = threading.Thread(target=run)
        worker.start()
        while 2 not in ends:
            time.sleep(0.0005)
        with manager._device_lock:  # acquired as soon as the cancelled request lets go of the device
            free = time.perf_counter()
        worker.join()
        step = ends[2] - ends[1]
        freed.append((free - ends[2]) / step)
        steps_ms.append(step * 1000)
    print(
        f"cancel asked at the end of step 2 of {args.steps}: the device free after {statistics.median(freed):.2f} "
        f"step times (median of {args.repeats}; max {max(freed):.2f}; the step before it took "
        f"{statistics.median(steps_ms):.1f} ms, median)"
    )


def show_waterfall(args: argparse.Namespace) -> None:
    from openai import OpenAI
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from neuron_app.engine.manager import PipelineManager
    from neuron_app.web.server import build_app, launch

    exporter = InMemorySpanExporter()
    tracing.setup(None, exporter=exporter)
    settings = script.tiny_settings([args.size], max_sequence_length=32, server_port=free_port())
    app = build_app(settings, PipelineManager(settings))
    launch(app, block=False)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{settings.server_port}/v1", api_key="unused", timeout=600)
        raw = client.images.with_raw_response.generate(
            prompt="a lighthouse at dawn", size=args.size, extra_body={"num_inference_steps": args.steps}
        )
        trace_id = int(raw.headers["traceparent"].split("-")[1], 16)
        print(f"traceparent: {raw.headers['traceparent']}")
        print(waterfall([s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]))
    finally:
        app.demo.close()
        tracing.shutdown()


def main() -> None:
    parser = script.parser("studies.ops_costs", __doc__)
    parser.add_argument("--size", default="128x128")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--waterfall", action="store_true", help="one request's trace instead (docs: 64x64, 2 steps)")
    args = parser.parse_args()
    (show_waterfall if args.waterfall else costs)(args)


if __name__ == "__main__":
    main()
