"""The safety classifier on the device (`safety_device = "device"`, engine/trust/safety_graph.py), on
neuron-emulated: one compiled graph under TorchNeuron's rules, compiled with the first shape, run by the device lane
before it lets the device go, so a flagged image never reaches the post stage and the host never classifies."""

from __future__ import annotations

from typing import Any

import pytest
from PIL import Image

from neuron_app.engine.trust.safety import TINY_FLAGGED_COLOUR
from neuron_app.errors import ContentRefused

PROMPT, SHAPE, STEPS = "a calm lake", "64x64", 2


@pytest.fixture(scope="module")
def manager(tmp_path_factory: pytest.TempPathFactory, shared_models: Any) -> Any:
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.settings import load_settings
    from tests.support import TINY_OVERRIDES, link_models

    cache_dir = link_models(tmp_path_factory.mktemp("cache"), shared_models)
    overrides = {"cache_dir": cache_dir, "device": "neuron-emulated", "resolutions": [SHAPE]}
    overrides |= {"safety_checker": "on", "safety_model": "tiny", "safety_device": "device", "postprocess_workers": 2}
    built = PipelineManager(load_settings(**(TINY_OVERRIDES | overrides)))
    # The first compile is the fixture's, whichever test runs first: what it counted is kept for the test that reads it.
    FIRST["outcome"] = built.compile_shape(SHAPE)
    FIRST["graphs"] = built.counter.graphs
    return built


#: The module's first compile (the fixture's) and the graphs counted right after it.
FIRST: dict[str, Any] = {}


def test_the_device_classifier_compiles_with_the_first_shape_and_then_nothing_compiles(manager: Any) -> None:
    outcome = FIRST["outcome"]
    safety = manager.status().safety
    assert safety["device"] == "device" and safety["graphs"] == 1, safety
    assert FIRST["graphs"] == outcome.graphs + 1  # the classifier's graph, counted with the model's
    graphs, eager = manager.counter.graphs, manager.status().eager_compiles
    record = manager.generate(PROMPT, SHAPE, STEPS, 1)
    assert record.safety == "passed" and record.encoded.data[:4] == b"\x89PNG"
    assert (record.graphs_compiled, record.eager_compiles) == (0, 0)
    assert (manager.counter.graphs, manager.status().eager_compiles) == (graphs, eager)
    assert manager._device_lock.holds  # the lane's device work, the classification included
    assert manager.safety._batcher.batches == []  # the host never classified an image
    assert manager.status().neuron_rules["violation_count"] == 0


def test_the_device_graph_flags_what_the_host_classifier_flags(manager: Any) -> None:
    manager.compile_shape(SHAPE)
    with pytest.raises(ContentRefused, match="flagged by this server's safety checker"):
        manager.safety.check(Image.new("RGB", (256, 256), TINY_FLAGGED_COLOUR), manager.backend)
    noise = Image.effect_noise((256, 256), 40).convert("RGB")
    assert manager.safety.check(noise, manager.backend) == "passed"
    assert manager.safety._batcher.batches == []


def test_a_flagged_image_is_refused_on_the_lane_and_never_reaches_the_post_stage(manager: Any) -> None:
    manager.compile_shape(SHAPE)
    before = dict(manager.status().stages["post"])
    manager.safety.threshold = 1e-30  # every image's score is above it: flagged
    try:
        with pytest.raises(ContentRefused):
            manager.generate(PROMPT, SHAPE, STEPS, 2)
    finally:
        manager.safety.threshold = 0.5
    post = manager.status().stages["post"]
    assert (post["done"], post["failed"]) == (before["done"], before["failed"])  # refused before any host slot
    assert not manager._device_lock.locked()
    assert manager.generate(PROMPT, SHAPE, STEPS, 3).safety == "passed"
