"""Several images for one request: one validation, then `n` runs with seeds seed, seed+1, ...

Static shapes make a batch dimension one more compile per shape on Neuron, so n images reuse the
batch-1 graph, one after another (a replica front end may spread the calls). Shared by the page
and the OpenAI-compatible API; every refusal happens before the first image, so a bad request
costs nothing, and an edit's references are decoded once for all n images.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from neuron_app import tracing
from neuron_app.engine import requests
from neuron_app.engine.contract import Manager
from neuron_app.engine.records import GenerationRecord, ManagerStatus, ProgressCallback, ProgressEvent
from neuron_app.engine.requests import Request


def offered_shapes(status: ManagerStatus) -> list[str]:
    """The shapes a request may ask for right now, from a manager's status (in-process or replicas)."""
    return [name for name, shape in status.shapes.items() if shape.offered]


def validate_many(
    manager: Manager, prompt: Any, resolution: Any, steps: Any, seed: Any, n: Any, **options: Any
) -> tuple[Request, int]:
    """All the checks of `n` generations at once (the manager's own `validate`): the first image's request, and n."""
    with tracing.span("validation", n=str(n)):
        count = requests.check_images(n, manager.settings.max_images)
        first = requests.check_seed_run(seed, count)
        return manager.validate(prompt, resolution, steps, first, **options), count


def _numbered(progress: ProgressCallback | None, index: int, count: int) -> ProgressCallback | None:
    """Progress events of image `index` say so ("image 2/3: Step 1/4") when there are several."""
    if progress is None or count == 1:
        return progress

    def on_event(event: ProgressEvent) -> None:
        progress(dataclasses.replace(event, message=f"image {index + 1}/{count}: {event.message}"))

    return on_event


def run_many(
    manager: Manager,
    request: Request,
    count: int,
    progress: ProgressCallback | None = None,
    on_record: Callable[[GenerationRecord], None] | None = None,
) -> list[GenerationRecord]:
    """`count` images of one validated request, with consecutive seeds, through the manager's device entry;
    `on_record` gets each image as it is made (the page's Stop keeps those finished before it)."""
    records = []
    for i in range(count):
        record = manager.run(
            dataclasses.replace(request, seed=request.seed + i), progress=_numbered(progress, i, count)
        )
        if on_record is not None:
            on_record(record)
        records.append(record)
    return records


def generate_many(
    manager: Manager,
    prompt: Any,
    resolution: Any,
    steps: Any,
    seed: Any,
    n: Any = 1,
    progress: ProgressCallback | None = None,
    on_record: Callable[[GenerationRecord], None] | None = None,
    **options: Any,
) -> list[GenerationRecord]:
    """`n` images with consecutive seeds: validated once, then `run_many`; options are `validate`'s."""
    request, count = validate_many(manager, prompt, resolution, steps, seed, n, **options)
    return run_many(manager, request, count, progress, on_record)
