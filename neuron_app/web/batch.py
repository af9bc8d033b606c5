"""Several images for one request: `n` calls of `generate` with seeds seed, seed+1, ...

Static shapes make a batch dimension one more compile per shape on Neuron, so n images reuse the
batch-1 graph, one after another (a replica front end may spread the calls). Shared by the page
and the OpenAI-compatible API; every refusal happens before the first image, so a bad request
costs nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from neuron_app.engine import requests
from neuron_app.engine.records import GenerationRecord, ManagerStatus, ProgressCallback, ProgressEvent


def offered_shapes(status: ManagerStatus) -> list[str]:
    """The shapes a request may ask for right now, from the manager's status (works for any ManagerLike)."""
    return [name for name, shape in status.shapes.items() if shape.offered]


def validate_many(manager: Any, prompt: Any, resolution: Any, steps: Any, seed: Any, n: Any, **options: Any) -> int:
    """All the checks of `n` generations at once (the same `validate` as `generate`); returns n."""
    count = requests.check_images(n, manager.settings.max_images)
    first = requests.check_seed_run(seed, count)
    offered = offered_shapes(manager.status())
    requests.validate(manager.settings, offered, prompt, resolution, steps, first, **options)
    return count


def _numbered(progress: ProgressCallback | None, index: int, count: int) -> ProgressCallback | None:
    """Progress events of image `index` say so ("image 2/3: Step 1/4") when there are several."""
    if progress is None or count == 1:
        return progress

    def on_event(event: ProgressEvent) -> None:
        progress(dataclasses.replace(event, message=f"image {index + 1}/{count}: {event.message}"))

    return on_event


def generate_many(
    manager: Any,
    prompt: Any,
    resolution: Any,
    steps: Any,
    seed: Any,
    n: Any = 1,
    progress: ProgressCallback | None = None,
    **options: Any,
) -> list[GenerationRecord]:
    """`n` images with consecutive seeds through the manager's one device entry; options pass unchanged."""
    count = validate_many(manager, prompt, resolution, steps, seed, n, **options)
    first = int(seed)
    return [
        manager.generate(prompt, resolution, steps, first + i, progress=_numbered(progress, i, count), **options)
        for i in range(count)
    ]
