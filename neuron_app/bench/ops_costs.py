"""python -m neuron_app.bench.ops_costs: what tracing adds to a warm request, and how long a cancel takes to free the
device, in step times (tiny model, aot_eager, in process; ratios, not seconds, are what carry to other machines).
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time

from neuron_app import tracing
from neuron_app.bench import script
from neuron_app.engine.records import ProgressEvent
from neuron_app.errors import Cancelled


def main() -> None:
    parser = script.parser("ops_costs", __doc__)
    parser.add_argument("--size", default="128x128")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
