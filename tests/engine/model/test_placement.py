"""The `placement` setting: each component on its own NeuronCore of the ones the process holds (issue 50).

tiny-shapes on `neuron-emulated`, where `neuron:N` is the N-th held core with its own HBM account
(backends/emulator/numbering.py): the images are judged by what they show and must equal the one-core pipeline's,
the status and each image's record say which core held what, and the emulator's per-core accounts agree.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from neuron_app.engine.model.shapes_world import EVAL_SCENES, judge
from tests.support import SHAPES_OVERRIDES, link_models

SHAPE = "128x128"
SCENES = EVAL_SCENES[:4]


def _manager(tmp_path: Any, shared_models: Any, **overrides: Any) -> Any:
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.settings import load_settings

    cache = link_models(tmp_path / "cache", shared_models)
    settings = SHAPES_OVERRIDES | {"device": "neuron-emulated", "cache_dir": cache, "resolutions": [SHAPE]}
    settings["compile_mode"] = "eager"  # where the weights live is the point here, not the graphs
    return PipelineManager(load_settings(**(settings | overrides)))


@pytest.fixture
def two_cores(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
    yield


def _bytes_by_core(manager: Any) -> dict[int, int]:
    memory = manager.backend.emulator.memory
    return {d["index"]: memory.in_use_of(d["index"]) for d in manager.backend.emulator.devices()}


def test_text_encoder_apart_draws_what_it_is_asked_with_the_encoder_on_its_own_core(
    two_cores: None, tmp_path: Any, shared_models: Any
) -> None:
    """NEURON_APP_PLACEMENT=text-encoder-apart over NeuronCores 0-1: the prompt is encoded on neuron:1 and carried
    to the transformer on neuron:0 through the host (the emulator refuses an op that mixes two cores, and a direct
    copy between them with TorchNeuron's text), with each stage's core current (a graph runs on the current device),
    the judge reads the scenes, and the status and each record name the cores."""
    apart = _manager(tmp_path, shared_models, placement="text-encoder-apart")
    # The emulated device is this process's: what an earlier test's managers left on it (a random order ran the
    # every-placement test first, stop 59): its garbage is collected now, and what is still held is counted before
    # this manager loads and taken off below.
    gc.collect()
    earlier = _bytes_by_core(apart)
    from neuron_app.web.page.views import status_markdown

    status = apart.status().placement
    assert status["name"] == "text-encoder-apart" and status["setting"] == "text-encoder-apart"
    page = status_markdown(apart.status())
    assert "**Placement** text-encoder-apart: cores transformer on 0, text encoder on 1, vae on 0" in page
    assert status["cores"] == {"transformer": [0], "text_encoder": [1], "vae": [0]}
    both = 0
    for i, scene in enumerate(SCENES):
        record = apart.generate(scene.prompt, SHAPE, 4, 100 + i)
        verdict = judge(record.image).matches(scene)
        both += verdict["colour"] and verdict["background"]
        assert record.info()["placement"] == {"name": "text-encoder-apart", "cores": status["cores"]}
    assert both >= len(SCENES) - 1, both
    rules = apart.status().neuron_rules
    assert rules["violation_count"] == 0, rules["violations"]
    pipe = apart.pipe
    with apart.backend.device_work():
        assert str(pipe.text_encoder.device) == "neuron:1" and str(pipe.transformer.device) == "neuron:0"
        assert str(pipe._execution_device) == "neuron:0"
    held = {core: held - earlier.get(core, 0) for core, held in _bytes_by_core(apart).items()}
    tensors = [*pipe.text_encoder.parameters(), *pipe.text_encoder.buffers()]
    encoder = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    assert held[1] == sum(encoder.values()) and held[0] > held[1], held  # the encoder's weights, on core 1 only


def test_every_placement_draws_the_same_image_as_one_core(tmp_path: Any, shared_models: Any, monkeypatch: Any) -> None:
    """The placement moves where the weights live, not what is computed: with the VAE on a third core too (the
    execution device then follows the transformer, not the VAE that diffusers finds first), the same seed gives
    the same pixels as `together`."""
    import numpy as np
    from PIL import Image

    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-2")
    scene = SCENES[1]
    images = {}
    for name in ("together", "text-encoder-and-vae-apart"):
        manager = _manager(tmp_path / name, shared_models, placement=name)
        images[name] = np.asarray(manager.generate(scene.prompt, SHAPE, 4, 7).image)
        assert manager.status().neuron_rules["violation_count"] == 0
        if name != "together":
            assert manager.status().placement["cores"] == {"transformer": [0], "text_encoder": [1], "vae": [2]}
            with manager.backend.device_work():
                assert str(manager.pipe._execution_device) == "neuron:0"
                assert str(manager.pipe.vae.device) == "neuron:2"
        manager.close()
        del manager
    assert np.array_equal(images["together"], images["text-encoder-and-vae-apart"])
    verdict = judge(Image.fromarray(images["together"])).matches(scene)
    assert verdict["colour"] and verdict["background"], verdict


def test_a_placement_needing_more_cores_than_held_is_refused_at_start_naming_both(
    tmp_path: Any, shared_models: Any, monkeypatch: Any
) -> None:
    from neuron_app.errors import DeviceUnavailable

    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0")
    with pytest.raises(DeviceUnavailable, match="needs 3 NeuronCores but this process holds 1") as refused:
        _manager(tmp_path, shared_models, placement="text-encoder-and-vae-apart")
    assert len(str(refused.value).splitlines()) == 1


def test_auto_serves_together_for_a_model_the_plan_does_not_know_and_cpu_ignores_placement(
    two_cores: None, tmp_path: Any, shared_models: Any
) -> None:
    auto = _manager(tmp_path / "auto", shared_models)
    assert auto.status().placement == {"name": None, "setting": "auto", "cores": {}, "why": auto.placement.why}
    auto.ensure_loaded()
    placed = auto.status().placement
    assert placed["name"] == "together" and placed["cores"]["text_encoder"] == [0]
    assert "not a model the plan knows" in placed["why"]
    cpu = _manager(tmp_path / "cpu", shared_models, device="cpu", placement="text-encoder-apart")
    view = cpu.status().placement
    assert view["name"] == "together" and view["setting"] == "text-encoder-apart" and "does not apply" in view["why"]


def test_tp_serves_together_only(make_settings: Any) -> None:
    from neuron_app.errors import SettingsError

    with pytest.raises(SettingsError, match="TP serves placement=together only"):
        make_settings(tp_degree=2, placement="text-encoder-apart")
    assert make_settings(tp_degree=2, placement="together").placement == "together"


def test_a_replica_asks_ray_for_the_cores_its_placement_holds(make_settings: Any) -> None:
    """Issue 56: a replica's Ray resources cover its topology block (the placement's cores, or its TP group's),
    with Ray's own core IDs turned off (the replica exports its block); `cores_per_replica` is CPUs only."""
    from neuron_app.scale.serve_app import NOSET_CORES_VAR, actor_options
    from neuron_app.scale.topology import settle

    def options(**overrides: Any) -> dict[str, Any]:
        return actor_options(settle(make_settings(visible_cores="0-3", **overrides)))

    for placement, cores in [("together", 1), ("text-encoder-apart", 2), ("text-encoder-and-vae-apart", 3)]:
        neuron = options(device="neuron", placement=placement)
        assert neuron["resources"] == {"neuron_cores": cores}, placement
        assert neuron["runtime_env"] == {"env_vars": {NOSET_CORES_VAR: "1"}}
        assert options(device="cuda", placement=placement)["num_gpus"] == cores, placement
    assert options(device="neuron", cores_per_replica=4)["resources"] == {"neuron_cores": 1}
    assert options(device="neuron", tp_degree=2, replicas=2)["resources"] == {"neuron_cores": 2}
