"""The neuron code path, run for real on CPU under TorchNeuron's rules (device = neuron-emulated).

Each rule is shown catching a deliberate violation; the app's own neuron path (the tiled VAE, token families,
edits, LoRA switches, the persistent cache, the host decode) is shown passing them, with eager compiles
counted like NEFFs: once per op signature, remembered across a restart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from neuron_app.errors import NeuronRuleViolation

SHAPES = ["64x64", "128x64", "64x128", "128x128"]  # 128x128: the merge test's own (the family test counts from fresh)


@pytest.fixture
def emulator(tmp_path: Path) -> Any:
    from neuron_app.backends.emulator.rules import NeuronEmulator

    return NeuronEmulator(tmp_path / "neff-emulated")


def on_device(emulator: Any, tensor: Any) -> Any:
    return emulator.place(tensor, True)


def test_the_old_in_place_tile_blend_breaks_the_non_contiguous_rule(emulator: Any) -> None:
    """The tiled decoder used to blend with `out[:, :, ys, xs] += piece * weight` on the device (review B2):
    TorchNeuron refuses writes into a non-contiguous output ('Cannot process non-contiguous tensors')."""
    import torch

    out = on_device(emulator, torch.zeros(1, 3, 64, 64))
    piece = on_device(emulator, torch.ones(1, 3, 32, 32))
    with emulator.device_work(), pytest.raises(NeuronRuleViolation) as info:
        out[:, :, 8:40, 8:40] += piece * 0.5
    message = str(info.value)
    assert message.startswith("neuron rule:") and "aten.add_" in message and "non-contiguous" in message
    assert "(1, 3, 32, 32)" in message
    with emulator.device_work():  # a contiguous view (leading dims) and a host canvas are fine
        out[0:1] += 1
        host = out.cpu()
        host[:, :, 8:40, 8:40] += piece.cpu()
    assert emulator.snapshot()["violation_count"] == 1


def test_random_numbers_on_the_device_break_a_rule(emulator: Any) -> None:
    import torch

    with emulator.device_work():
        with pytest.raises(NeuronRuleViolation, match=r"^neuron rule: torch\.randn\(device='neuron'\)"):
            torch.randn(4, device="neuron")
        latent = on_device(emulator, torch.zeros(4))
        with pytest.raises(NeuronRuleViolation, match=r"^neuron rule: .*random numbers on the device"):
            latent.normal_()
        cpu = torch.Generator(device="cpu").manual_seed(0)  # what the app does: a CPU generator, then a move
        moved = torch.randn(4, generator=cpu).to("neuron")
        assert moved.device.type == "neuron" and emulator.is_device(moved)


def test_dynamic_shapes_in_a_compiled_graph_break_a_rule(emulator: Any) -> None:
    import torch

    from neuron_app.engine.compile.compiler import CountingBackend

    counter = CountingBackend("aot_eager", check=emulator.check_graph)
    fn = emulator.graph(torch.compile(lambda x: x * 2 + 1, backend=counter, fullgraph=True, dynamic=True), "toy")
    with emulator.device_work(), pytest.raises(Exception) as info:
        fn(on_device(emulator, torch.ones(3, 5)))
    from neuron_app.errors import rule_of

    rule = rule_of(info.value)
    assert rule is not None and str(rule).startswith("neuron rule: a compiled graph has dynamic shapes")
    static = emulator.graph(torch.compile(lambda x: x * 3, backend=counter, fullgraph=True, dynamic=False), "toy2")
    with emulator.device_work():
        assert emulator.is_device(static(on_device(emulator, torch.ones(3, 5))))


def test_mixing_host_and_device_tensors_and_numpy_of_a_device_tensor_break_rules(emulator: Any) -> None:
    import torch

    dev = on_device(emulator, torch.ones(2, 3))
    with emulator.device_work():
        host = torch.ones(2, 3, device="cpu")
        with pytest.raises(NeuronRuleViolation, match=r"aten\.add\.Tensor mixes device and host tensors"):
            dev + host
        assert emulator.is_device(dev + torch.tensor(2.0))  # a 0-dim host tensor is a scalar: allowed
        with pytest.raises(NeuronRuleViolation, match=r"numpy\(\) of a device tensor"):
            dev.numpy()
        assert dev.cpu().numpy().shape == (2, 3)
        graph = emulator.graph(lambda x: x + 1, "toy")
        with pytest.raises(NeuronRuleViolation, match=r"host tensor .* passed to the compiled device graph"):
            graph(host)


def test_device_tensors_report_the_neuron_device_and_host_copies_do_not(emulator: Any) -> None:
    import torch

    with emulator.device_work():
        x = torch.zeros(2, device="neuron")
        assert x.device == torch.device("neuron", 0) and not x.is_cpu
        y = x * 2
        assert y.device.type == "neuron"
        z = y.cpu()
        assert z is not y and z.device.type == "cpu" and emulator.is_host(z)
        w = z.to(x.device)
        assert w.device.type == "neuron"


def test_eager_signatures_compile_once_and_survive_a_restart(tmp_path: Path) -> None:
    import torch

    from neuron_app.backends.emulator.rules import NeuronEmulator

    first = NeuronEmulator(tmp_path / "neff")
    with first.device_work():
        a = torch.ones(4, 4, device="neuron")
        _ = a * 2
        _ = a * 3  # the same signature (op, shapes, dtypes): no second compile
        _ = torch.ones(8, 4, device="neuron") * 2  # a new shape: a new compile
    assert first.eager_compiles == 2
    again = NeuronEmulator(tmp_path / "neff")  # a new process on the same cache folder
    with again.device_work():
        _ = torch.ones(4, 4, device="neuron") * 5
    assert again.eager_compiles == 0 and again.store.count() == 2
    assert len(list((tmp_path / "neff").rglob("*.neff"))) == 2  # NEFF-style: <dir>/ab/cd/<32 hex>.neff


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory, shared_models: Path) -> Any:
    """A manager on neuron-emulated (tiny model, aot_eager standing in for neuronx-cc, the tiled VAE on)."""
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.settings import load_settings
    from tests.support import TINY_OVERRIDES, link_models

    cache = link_models(tmp_path_factory.mktemp("emulated"), shared_models)
    settings = load_settings(
        **(TINY_OVERRIDES | {"device": "neuron-emulated", "resolutions": SHAPES, "cache_dir": cache})
    )
    return PipelineManager(settings)


def test_the_neuron_path_serves_a_token_family_and_ready_means_ready(emulated: Any) -> None:
    """First request of a shape compiles graphs and eager ops; the next compiles nothing. A sibling of a token
    family (64x128 after 128x64) reuses the transformer graph but still meets the per-shape eager glue, so it
    is its own key; once the status calls it ready, its next request compiles nothing of any kind."""
    status = emulated.status()
    assert status.device == "neuron-emulated" and emulated.vae_compiled
    first = emulated.generate("a lighthouse", "64x64", 4, 1)
    assert first.cache.value == "miss" and first.eager_compiles > 0 and "eager_compiles" in first.info()
    second = emulated.generate("another prompt", "64x64", 4, 2)
    assert second.cache.value == "memory" and second.eager_compiles == 0 and second.graphs_compiled == 0

    wide = emulated.generate("a lighthouse", "128x64", 4, 1)
    assert wide.eager_compiles > 0
    graphs_before = emulated.status().compiles
    tall = emulated.generate("a lighthouse", "64x128", 4, 1)
    assert tall.graphs_compiled == 0 and emulated.status().compiles == graphs_before  # the family's graph
    assert tall.eager_compiles > 0, "the sibling's glue runs at its own shape: eager compiles, as on Neuron"
    status = emulated.status()
    assert status.shapes["64x128"].state.value == "ready"
    again = emulated.generate("a third prompt", "64x128", 4, 7)
    assert again.eager_compiles == 0 and again.graphs_compiled == 0 and again.cache.value == "memory"

    rules = status.neuron_rules
    assert rules["mode"] == "enforce" and rules["violation_count"] == 0 and rules["eager_signatures"] > 0
    assert status.to_dict()["neuron_rules"]["eager_signatures"] == rules["eager_signatures"]
    assert status.eager_compiles == rules["eager_compiles"]


def test_an_edit_and_a_lora_switch_pass_the_rules(make_settings: Any) -> None:
    from PIL import Image

    from neuron_app.engine.manager import PipelineManager

    manager = PipelineManager(make_settings(device="neuron-emulated", resolutions=["64x64"], loras={"ink": "tiny:1"}))
    reference = Image.new("RGB", (64, 64), (200, 40, 40))
    edit = manager.generate("make it blue", "64x64", 2, 3, references=[reference])
    assert edit.eager_compiles > 0 and edit.references
    styled = manager.generate("a fox", "64x64", 2, 3, lora="ink", lora_scale=0.5)
    plain = manager.generate("a fox", "64x64", 2, 3)
    assert styled.lora == "ink" and plain.lora == "none"
    assert manager.status().neuron_rules["violation_count"] == 0


def test_a_request_that_breaks_a_rule_fails_with_the_rule(make_settings: Any) -> None:
    """A decode that blends in place on the device (the old tiler) fails that request with `neuron rule:`;
    the server goes on serving."""
    from neuron_app.engine.manager import PipelineManager

    manager = PipelineManager(make_settings(device="neuron-emulated", resolutions=["64x64"]))
    manager.generate("warm", "64x64", 2, 0)
    decode = manager.pipe.vae.decode

    def in_place_decode(z: Any, return_dict: bool = True, generator: Any = None) -> Any:
        image = decode(z, return_dict=False)[0].to("neuron")
        canvas = image.clone()
        canvas[:, :, 8:40, 8:40] += image[:, :, 8:40, 8:40]  # the old blend, on the device
        return (canvas,)

    manager.pipe.vae.decode = in_place_decode
    with pytest.raises(NeuronRuleViolation) as info:
        manager.generate("a fox", "64x64", 2, 1)
    assert str(info.value).startswith("neuron rule: aten.add_")
    manager.pipe.vae.decode = decode
    assert manager.generate("a fox", "64x64", 2, 1).image is not None
    assert manager.status().neuron_rules["violation_count"] == 1


def test_precompiled_shapes_meet_no_compile_after_a_restart(make_settings: Any, tmp_path: Path) -> None:
    """What `python -m neuron_app precompile` does, then a new process on the same cache folder: every listed
    shape's first request is a disk hit with 0 eager compiles (the emulated NEFF-style artifacts are there)."""
    from neuron_app.engine.manager import PipelineManager

    settings = make_settings(device="neuron-emulated", cache_dir=tmp_path / "cache")
    first = PipelineManager(settings)
    for shape in settings.resolutions:
        first.compile_shape(shape)
    restarted = PipelineManager(settings)
    for shape in settings.resolutions:
        assert restarted.status().shapes[shape].manifest == "precompiled"
        record = restarted.generate("after the restart", shape, settings.default_steps, 5)
        assert record.eager_compiles == 0, shape
        assert record.cache.value in ("disk", "memory"), (shape, record.cache)
    assert restarted.status().neuron_rules["eager_compiles"] == 0


def test_decoding_on_the_host_needs_no_vae_graph(make_settings: Any) -> None:
    from neuron_app.engine.manager import PipelineManager

    manager = PipelineManager(make_settings(device="neuron-emulated", resolutions=["64x64"], vae_device="cpu"))
    record = manager.generate("a fox", "64x64", 2, 1)
    status = manager.status()
    assert not manager.vae_compiled and status.vae_compiles == 0 and record.image.size == (64, 64)
    assert status.neuron_rules["violation_count"] == 0
    assert manager.fingerprint_fields["vae_device"] == "cpu"


def test_the_emulated_fingerprint_never_passes_for_neffs(make_settings: Any) -> None:
    from neuron_app.engine.manager import PipelineManager

    fields = PipelineManager(make_settings(device="neuron-emulated")).fingerprint_fields
    assert fields["device"] == "neuron-emulated" and "emulator" in fields
    assert "TORCH_NEURONX_ENABLE_NKI_SDPA" in fields and "platform_target" in fields


def _png(path: Path, size: tuple[int, int]) -> Path:
    from PIL import Image

    Image.new("RGB", size, (30, 120, 200)).save(path)
    return path


@pytest.mark.slow
def test_python_app_py_serves_the_page_generate_edit_and_status_on_neuron_emulated(
    run_app_py: Any, tmp_path: Path
) -> None:
    """`NEURON_APP_DEVICE=neuron-emulated python app.py` with the tiny model: the page, `generate`, `edit` and
    `status` through gradio_client; every info carries `eager_compiles`, a second request of a shape meets none."""
    import urllib.request

    from gradio_client import Client, handle_file

    from tests.support import PATIENT_HTTP

    app = run_app_py(device="neuron-emulated", resolutions=["64x64"])
    app.wait_up(timeout=180)
    with urllib.request.urlopen(app.url, timeout=30) as page:
        assert page.status == 200
    client = Client(app.url, verbose=False, httpx_kwargs=PATIENT_HTTP)
    _, first = client.predict("a lighthouse", "64x64", 2, 1, api_name="/generate")
    _, second = client.predict("a lighthouse", "64x64", 2, 2, api_name="/generate")
    assert first["eager_compiles"] > 0 and second["eager_compiles"] == 0 and second["cache"] == "memory"
    reference = handle_file(str(_png(tmp_path / "ref.png", (64, 64))))
    _, edit = client.predict("make it red", [reference], "64x64", 2, 3, api_name="/edit")
    assert edit["references"] and "eager_compiles" in edit
    status = client.predict(api_name="/status")
    assert status["device"] == "neuron-emulated"
    assert status["neuron_rules"]["mode"] == "enforce" and status["neuron_rules"]["violation_count"] == 0
    assert status["shapes"]["64x64"]["state"] == "ready"
    assert "execution-error fallback off (set by the app)" in status["fallback"]


def test_replica_statuses_merge_the_eager_compiles_and_the_rule_record(emulated: Any) -> None:
    """Through replicas the page reads merged statuses: eager compiles and the rules' counts are summed."""
    from neuron_app.scale.status_merge import merge_statuses

    emulated.generate("merge", "128x128", 2, 1)
    one = emulated.status()
    merged = merge_statuses(emulated.settings, [one, one], [])
    assert merged.eager_compiles == 2 * one.eager_compiles > 0
    assert merged.neuron_rules["eager_compiles"] == 2 * one.neuron_rules["eager_compiles"]
    assert merged.neuron_rules["mode"] == "enforce" and merged.shapes["128x128"].ready_replicas == 2


def test_the_backend_places_a_component_on_the_second_core_it_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 50's placement on neuron-emulated: a process holding cores 0-1 has `neuron:0` and `neuron:1`
    (`backend.core_ids()`); `adopt_module(module, 1)` puts a component's weights on core 1's
    account (before or after `adopt`), a tensor moved with `.to("neuron:1")` feeds it, one left on neuron:0 is
    refused with torch's message, and an index past the cores held fails as TorchNeuron's does."""
    import torch

    from neuron_app.backends.emulator.numbering import STATE
    from neuron_app.backends.neuron_emulated import NeuronEmulatedBackend

    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "2-3")
    backend = NeuronEmulatedBackend()
    try:
        backend.check_device()
        backend.prepare_cache(tmp_path)
        assert backend.cores == [2, 3] and backend.core_ids() == [2, 3]
        with pytest.raises(RuntimeError, match=r"^Device index 2 is out of range\. Valid range is 0 to 1 for this"):
            STATE.check(2)
        memory = backend.emulator.memory  # one per process: other managers' weights may be on it already
        before = (memory.in_use_of(0), memory.in_use_of(1))
        encoder, transformer = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        backend.adopt_module(encoder)  # adopt first (the whole pipeline on the first core), then moved
        backend.adopt_module(encoder, 1)
        backend.adopt_module(transformer, 0)
        devices = {d["index"]: d for d in backend.rules_status()["devices"]}
        assert (devices[0]["core"], devices[1]["core"]) == (2, 3)
        weights = 8 * 8 * 4 + 8 * 4  # one Linear(8, 8) in float32, each on its own core's account
        assert (memory.in_use_of(0) - before[0], memory.in_use_of(1) - before[1]) == (weights, weights)
        with backend.device_work():
            assert encoder.weight.device == torch.device("neuron", 1)
            embedding = encoder(torch.ones(1, 8).to("neuron:1"))
            assert embedding.device.index == 1
            with pytest.raises(NeuronRuleViolation, match="found at least two devices, neuron:0 and neuron:1!"):
                transformer(embedding)
            with pytest.raises(NeuronRuleViolation, match="Device-to-device copy requires tensors on same"):
                embedding.to("neuron:0")  # TorchNeuron refuses a direct copy between two cores
            assert transformer(embedding.cpu().to("neuron:0")).device.index == 0  # through the host
    finally:
        STATE.hold([0])
