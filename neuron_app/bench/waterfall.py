"""python -m neuron_app.bench.waterfall: one OpenAI request to the tiny app, its trace as a text waterfall.

The example in docs/operations.md: the real app (tiny model, aot_eager, a fresh cache folder, so the first request
compiles) with the OpenTelemetry SDK's in-memory exporter, one `openai` SDK request, and every span of its trace
drawn on one time axis, children under their parents.
"""

from __future__ import annotations

from typing import Any

from neuron_app import tracing
from neuron_app.bench import script
from neuron_app.bench.common import free_port

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


def main() -> None:
    parser = script.parser("waterfall", __doc__)
    parser.add_argument("--size", default="64x64")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
