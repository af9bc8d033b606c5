"""The emulator's rules added after the second review (§3), each violated on purpose, and the findings they
let the app fix on CPU: the NKI attention gate per shape (N1), eager compiles counted from graph misses only
(N7), fallbacks per shape with the host glue apart (N8/N9), latched device errors (N14)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from neuron_app.backends.nki_gate import gate
from neuron_app.errors import NeuronRuleViolation


@pytest.fixture
def emulator(tmp_path: Path) -> Any:
    from neuron_app.backends.emulator.cache import forget_memory
    from neuron_app.backends.emulator.rules import NeuronEmulator

    forget_memory()
    return NeuronEmulator(tmp_path / "neff-emulated")


def on_device(emulator: Any, tensor: Any) -> Any:
    return emulator.place(tensor, True)


def compiled(emulator: Any, fn: Any, name: str = "toy") -> Any:
    import torch

    from neuron_app.engine.compile.compiler import CountingBackend

    counter = CountingBackend("aot_eager", check=emulator.check_graph)
    return emulator.graph(torch.compile(fn, backend=counter, fullgraph=True, dynamic=False), name)


def test_an_op_without_a_neuron_kernel_falls_back_to_the_cpu_with_a_host_round_trip(emulator: Any) -> None:
    import torch

    out = on_device(emulator, torch.zeros(4, 3))
    index = on_device(emulator, torch.tensor([[0, 1, 2], [3, 0, 1]]))
    src = on_device(emulator, torch.ones(2, 3))
    compiles = emulator.eager_compiles
    with emulator.device_work():
        out.scatter_(0, index, src)
        out.scatter_(0, index, src)
    assert emulator.fallback_invocations() == ["aten::scatter_.src", "aten::scatter_.src"]
    assert emulator.host_round_trips == 2 and emulator.eager_compiles == compiles  # no NEFF for it
    assert emulator.int64_ops == 0  # scatter's int64 index went with the fallback, not to a device kernel


def test_int64_on_the_device_is_counted_as_converted(emulator: Any) -> None:
    import torch

    ids = on_device(emulator, torch.arange(6))
    with emulator.device_work():
        _ = ids + 1
    assert emulator.int64_ops == 1 and emulator.snapshot()["int64_ops"] == 1


def test_a_graph_computing_in_float64_fails(emulator: Any) -> None:
    import torch

    fn = compiled(emulator, lambda x: x.double() * 2)
    with emulator.device_work(), pytest.raises(Exception, match="computes in float64"):
        fn(on_device(emulator, torch.ones(3)))


def test_weights_past_one_cores_hbm_fail(tmp_path: Path) -> None:
    import torch

    from neuron_app.backends.emulator.rules import NeuronEmulator

    small = NeuronEmulator(tmp_path / "neff", hbm_gib=1 / 2**20)  # 1 KiB
    with pytest.raises(NeuronRuleViolation, match=r"Failed to allocate 4096 bytes on DEVICE .* capacity 1024 bytes"):
        small.adopt(torch.nn.Linear(32, 32))  # 4.2 KB of weights
    assert NeuronEmulator(tmp_path / "neff").adopt(torch.nn.Linear(32, 32)) == 2  # 24 GiB: fits


def test_copy_into_a_strided_view_is_allowed_but_other_strided_writes_fail(emulator: Any) -> None:
    import torch

    dev = on_device(emulator, torch.zeros(4, 4))
    host = torch.ones(4)
    with emulator.device_work():
        dev[:, 3] = host.to("neuron")  # TorchNeuron's Python copy_: a full-buffer copy
        assert emulator.strided_copies == 1 and emulator.violation_count == 0
        with pytest.raises(NeuronRuleViolation, match=r"aten\.add_"):
            dev[:, 2].add_(1)


def test_adopting_a_tensor_made_on_the_host_clears_its_host_mark(emulator: Any) -> None:
    """A model loaded while the rules are on: its weights were made on the host, then `pipe.to("neuron")`."""
    import torch

    layer = torch.nn.Linear(4, 4)
    emulator.place(list(layer.parameters()), False)  # made by host factories under the rules
    assert emulator.is_host(layer.weight)
    emulator.adopt(layer)
    x = on_device(emulator, torch.ones(2, 4))
    with emulator.device_work():
        y = layer(x)  # one tensor on one side: no "mixes device and host"
    assert emulator.is_device(y) and emulator.violation_count == 0


def test_a_latched_device_error_surfaces_at_the_next_synchronize_or_device_op_once(emulator: Any) -> None:
    import torch

    dev = on_device(emulator, torch.ones(3))
    emulator.latch("NEFF execution failed (FAKE)")
    with pytest.raises(NeuronRuleViolation, match="latched device error surfaced here: NEFF execution failed"):
        emulator.synchronize()
    emulator.synchronize()  # raised once, then clear
    emulator.latch("compile failed (FAKE)")
    with emulator.device_work(), pytest.raises(NeuronRuleViolation, match="compile failed"):
        _ = dev * 2
    with emulator.device_work():
        assert emulator.is_device(dev * 2)


def test_the_cache_looks_in_memory_then_on_disk_with_torchneurons_counters(tmp_path: Path) -> None:
    """A miss compiles; the same process again is an in-memory hit (no counter moves); a new process on the
    folder is a persistent hit."""
    from neuron_app.backends.emulator.cache import ArtifactStore, forget_memory

    forget_memory()
    store = ArtifactStore(tmp_path)  # its counters land when the device is synchronized (`flush`): T3
    assert store.record("graph", "g") is True and not store.flush() and store.counters() == (0, 1)
    assert store.record("graph", "g") is False and not store.flush() and store.counters() == (0, 1)
    assert store.stats["in_memory_hits"] == 1
    second_manager = ArtifactStore(tmp_path)  # same process: the memory layer is the process's
    assert second_manager.record("graph", "g") is False and not second_manager.flush()
    assert second_manager.counters() == (0, 0)
    forget_memory()  # a restart
    restarted = ArtifactStore(tmp_path)
    assert restarted.record("graph", "g") is False and not restarted.flush() and restarted.counters() == (1, 0)
    assert restarted.count() == 1


@pytest.mark.parametrize(
    ("q", "k", "masked", "why"),
    [
        ((1, 24, 4608, 128), (1, 24, 4608, 128), False, ""),
        ((1, 24, 4544, 128), (1, 24, 4544, 128), False, "L=4544 not a multiple of 512"),
        ((1, 24, 512, 256), (1, 24, 512, 256), False, "D=256 > 128"),
        ((32, 24, 512, 64), (32, 24, 512, 64), False, "B*H=768 > 512"),
        ((1, 2, 512, 16), (1, 2, 512, 16), True, "an attention mask"),
    ],
)
def test_the_nki_gate(q: tuple, k: tuple, masked: bool, why: str) -> None:
    assert why in gate(q, k, k, masked, 0.0) and (gate(q, k, k, masked, 0.0) == "") == (why == "")


def test_the_nki_gate_is_read_per_compiled_graph(emulator: Any) -> None:
    import torch
    import torch.nn.functional as F

    fn = compiled(emulator, lambda q: F.scaled_dot_product_attention(q, q, q))
    with emulator.device_work():
        fn(on_device(emulator, torch.ones(1, 2, 512, 16)))
        fn(on_device(emulator, torch.ones(1, 2, 48, 16)))
    first, second = emulator.snapshot()["graph_attention"]
    assert first["sdpa"] == 1 and first["nki"] is True
    assert second["nki"] is False and "L=48" in second["why_not"]


def test_nki_sdpa_off_is_read_at_each_graph_not_once_at_start(emulator: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """U4: TorchNeuron reads TORCH_NEURONX_ENABLE_NKI_SDPA at every SDPA decomposition, so a value set after start
    (diffusers' integration test sets it in a fixture) decides the next graph; set back, the gate decides again."""
    import torch
    import torch.nn.functional as F

    fn = compiled(emulator, lambda q: F.scaled_dot_product_attention(q, q, q))
    monkeypatch.setenv("TORCH_NEURONX_ENABLE_NKI_SDPA", "0")  # after the emulator started
    with emulator.device_work():
        fn(on_device(emulator, torch.ones(1, 2, 512, 16)))
    monkeypatch.setenv("TORCH_NEURONX_ENABLE_NKI_SDPA", "1")
    with emulator.device_work():
        fn(on_device(emulator, torch.ones(1, 2, 1024, 16)))
    off, on = emulator.snapshot()["graph_attention"]
    assert off["nki"] is False and off["why_not"] == "TORCH_NEURONX_ENABLE_NKI_SDPA=0"
    assert on["nki"] is True and on["why_not"] == ""


def test_with_nki_sdpa_off_neither_the_status_nor_the_selftest_says_yes(
    make_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """U4 on the app: at a shape whose joint sequence meets the gate (32 image + 480 text tokens = 512) with
    TORCH_NEURONX_ENABLE_NKI_SDPA=0 the status says no and the page lists it as decomposed; the selftest's verdict,
    which on a device reads "yes (measured)" when no kernel call failed, says why not (the kernel is never called,
    so no failure could be logged)."""
    from neuron_app.backends.nki_gate import nki_verdict
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.web.page.views import neuron_markdown

    assert nki_verdict(True, 0, 0)[0].startswith("yes (measured")  # a device, the kernel on, no failure logged
    monkeypatch.setenv("TORCH_NEURONX_ENABLE_NKI_SDPA", "0")
    settings = make_settings(
        device="neuron-emulated", resolutions=["128x64"], default_resolution="128x64", max_sequence_length=480
    )
    manager = PipelineManager(settings)
    manager.generate("a fox", "128x64", 2, 1)
    status = manager.status()
    assert status.to_dict()["shapes"]["128x64"]["nki_attention"] is False
    assert "yes: - · no (decomposed, slower): 128x64" in neuron_markdown(status)
    for gate_met in (True, False):
        verdict, _ = nki_verdict(gate_met, 0, 0)
        assert verdict.startswith("no (TORCH_NEURONX_ENABLE_NKI_SDPA=0") and "measured" not in verdict


def test_each_shape_says_whether_its_attention_takes_the_nki_kernel(make_settings: Any) -> None:
    """N1 on the app: the tiny transformer attends over image + max_sequence_length text tokens: 32 image tokens
    (128x64, and its sibling 64x128, which compiles no transformer graph of its own) + 480 make 512, the
    kernel; 16 (64x64) + 32 make 48, decomposed. Status and the page say which."""
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.web.page.views import neuron_markdown

    for text, shapes, nki in ((480, ["128x64", "64x128"], True), (32, ["64x64"], False)):
        settings = make_settings(
            device="neuron-emulated", resolutions=shapes, default_resolution=shapes[0], max_sequence_length=text
        )
        manager = PipelineManager(settings)
        for shape in shapes:
            manager.generate("a fox", shape, 2, 1)
        status = manager.status()
        for shape in shapes:
            assert status.to_dict()["shapes"][shape]["nki_attention"] is nki, (text, shape)
        assert ("yes: " if nki else "no (decomposed, slower): ") + ", ".join(shapes) in neuron_markdown(status)
        assert "**NKI attention (predicted by TorchNeuron's gate" in neuron_markdown(status)  # T10: not measured


def test_fallbacks_are_per_shape_once_each_and_the_unpack_is_host_glue(
    make_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """N8/N9: diffusers' latent unpack (scatter_.src, no Neuron kernel) falls back at every shape and is listed
    once per shape without marking it degraded; an op outside the glue list does mark it."""
    from neuron_app.engine.manager import PipelineManager

    manager = PipelineManager(make_settings(device="neuron-emulated", resolutions=["64x64", "128x64"]))
    manager.generate("a fox", "64x64", 2, 1)
    manager.generate("a fox", "128x64", 2, 1)
    for shape in ("64x64", "128x64"):
        row = manager.status().shapes[shape]
        assert row.fallback_ops == ["aten::scatter_.src"] and not row.degraded, (shape, row)
    assert "1 unimplemented op(s) ran on the CPU: aten::scatter_.src" in manager.status().fallback

    monkeypatch.setenv("NEURON_EMULATOR_UNIMPLEMENTED", "silu.default")
    slow = PipelineManager(make_settings(device="neuron-emulated", resolutions=["64x64"]))
    slow.generate("a fox", "64x64", 2, 1)
    row = slow.status().shapes["64x64"]
    assert row.degraded and "aten::silu.default" in row.fallback_ops


def test_eager_compiles_are_counted_from_the_misses_no_graph_caused(tmp_path: Path) -> None:
    """N7: after a restart the graph comes from disk (a hit) and two new eager ops miss; the old formula
    (misses - graphs) said 1, hiding one; the misses a graph's compile or first run caused are not eager."""
    from neuron_app.backends.neuron import NeuronBackend

    counters = [0, 0]

    class Metered(NeuronBackend):  # the real backend, its counters read from this list (a synchronous device)
        def cache_counters(self) -> tuple[int, int]:
            return counters[0], counters[1]

        def synchronize(self) -> None:
            return None

    backend = Metered()
    finish = backend.check_graph(None, [])

    def graph(*args: Any) -> str:
        counters[0] += 1  # its NEFF loaded from disk on the first run
        return "ran"

    run = finish(graph)
    assert run() == "ran" and backend.graph_misses == 0
    counters[1] += 2  # two eager ops compiled
    assert backend.eager_compile_count(graphs_total=1) == 2

    fresh = Metered()
    finish = fresh.check_graph(None, [])
    counters[1] += 1  # a cold graph: its compile misses
    finish(graph)
    assert fresh.graph_misses == 1 and fresh.eager_compile_count(graphs_total=1) == counters[1] - 1


def test_a_shapes_fallbacks_are_the_ops_whose_count_grew_during_its_warm_up() -> None:
    """get_fallback_ops() is process-wide and lists invocations: an op that fell back earlier counts for this
    shape only if it ran again; each is named once."""
    from neuron_app.backends.fallbacks import degrading, new_fallbacks

    before = ["aten::index_put_", "aten::scatter_.src", "aten::scatter_.src"]
    after = [*before, "aten::scatter_.src", "aten::scatter_.src", "aten::cumsum"]
    assert new_fallbacks(before, after) == ["aten::cumsum", "aten::scatter_.src"]
    assert new_fallbacks(after, after) == []
    assert degrading(["aten::scatter_.src", "aten.scatter_.src (float64)", "aten::cumsum"]) == ["aten::cumsum"]


def test_image_to_image_and_inpaint_at_a_ready_shape_compile_nothing(make_settings: Any) -> None:
    """N10: the warm-up runs an inpaint at each shape, so the VAE encoder at full resolution, the source's
    noising and the blend outside the mask are compiled before the shape is called ready."""
    from neuron_app.engine.manager import PipelineManager
    from tests.support import left_half_mask, png, source_image

    manager = PipelineManager(make_settings(device="neuron-emulated", resolutions=["64x64"]))
    manager.compile_shape("64x64")
    assert manager.status().shapes["64x64"].state.value == "ready"
    source = png(source_image())
    inpaint = manager.generate("a red door", "64x64", 4, 3, image=source, mask=left_half_mask())
    assert inpaint.source is not None and inpaint.source["masked"]
    assert inpaint.eager_compiles == 0 and inpaint.graphs_compiled == 0
    img2img = manager.generate("a red door", "64x64", 4, 3, image=source, strength=0.5)
    assert img2img.eager_compiles == 0 and img2img.graphs_compiled == 0
    assert manager.status().neuron_rules["violation_count"] == 0


def test_a_failed_request_drops_what_the_device_latched_so_the_next_one_succeeds(make_settings: Any) -> None:
    """N14: a call fails while the device holds a latched error (a NEFF it queued failed); the manager waits
    for the device and drops it, so the next, unrelated request does not inherit it."""
    from neuron_app.engine.manager import PipelineManager

    manager = PipelineManager(make_settings(device="neuron-emulated", resolutions=["64x64"]))
    manager.generate("a fox", "64x64", 2, 1)
    decode = manager.pipe.vae.decode

    def failing_decode(*args: Any, **kwargs: Any) -> Any:
        manager.backend.emulator.latch("NEFF execution failed (FAKE)")
        raise RuntimeError("FAKE: the decode failed")

    manager.pipe.vae.decode = failing_decode
    with pytest.raises(Exception, match="FAKE: the decode failed"):
        manager.generate("a fox", "64x64", 2, 2)
    manager.pipe.vae.decode = decode
    assert manager.generate("an unrelated fox", "64x64", 2, 3).image is not None


def test_a_meta_tensor_says_meta_under_the_rules(emulator: Any) -> None:
    """A host tensor answers `.device` for itself: a `meta` buffer that said `cpu` was never materialized by
    transformers (the text encoder's RoPE frequencies were left as uninitialized memory under `emulate`: a
    different image in every process)."""
    import torch

    meta = torch.empty(3, device="meta")
    with emulator.device_work():
        assert meta.device.type == "meta" and not meta.is_cpu
        assert torch.ones(2).device.type == "cpu" and on_device(emulator, torch.ones(2)).device.type == "neuron"


def test_the_docs_rule_table_names_exactly_the_registered_rules() -> None:
    """Item 5: docs/neuron-emulator.md's rule table has one row per rule in the emulator's registry and none
    besides, and each registered rule names a function that
    exists, so neither the table nor the registry can drift from the code."""
    import importlib
    import re

    from neuron_app.backends.emulator import RULES
    from tests.support import ROOT

    doc = (ROOT / "docs" / "neuron-emulator.md").read_text()
    section = doc[doc.index("## The rules\n") : doc.index("Not a rule, and named so")]
    rows = re.findall(r"^\| `([a-z0-9-]+)` \|", section, re.MULTILINE)
    assert len(rows) == len(set(rows)), rows
    assert set(RULES) == set(rows), set(RULES) ^ set(rows)
    for name, where in RULES.items():
        module, _, attribute = where.partition(":")
        found: object = importlib.import_module(module)
        for part in attribute.split("."):
            found = getattr(found, part)
        assert callable(found), (name, where)
    for name in ("compiled-graph memory", "NEFF scratchpad", "collectives"):
        assert f"**{name}**" in doc[doc.index("What the emulator cannot know") :], name


def test_bfloat16_convolutions_sum_in_float32_in_graphs_and_eagerly(emulator: Any) -> None:
    """A bfloat16 convolution on the device is summed in float32 and rounded once, as the TensorEngine does, in a
    device graph and eagerly alike: on a CPU without bfloat16 instructions torch's own took 250x as long (klein-4B's
    VAE tile timed CI out), and on one with them oneDNN sums in float32 too."""
    import torch
    import torch.nn.functional as F

    from neuron_app.engine.compile.compiler import CountingBackend

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(32, 32, 3, padding=1).to(torch.bfloat16)
    emulator.adopt(conv)
    seen: list[str] = []

    def check(gm: Any, example_inputs: Any, component: str = "transformer") -> None:
        emulator.check_graph(gm, example_inputs, component)
        seen.append(gm.code)

    counter = CountingBackend("aot_eager", check=check)
    graph = emulator.graph(torch.compile(lambda x: conv(x), backend=counter, fullgraph=True, dynamic=False), "conv")
    x = on_device(emulator, torch.randn(1, 32, 16, 16).to(torch.bfloat16))
    with torch.no_grad(), emulator.device_work():
        from_graph, eager = graph(x), conv(x)
    wide = F.conv2d(x.float(), conv.weight.float(), conv.bias.float(), padding=1)
    assert len(seen) == 1 and "accumulate_in_float32" in seen[0]
    assert from_graph.dtype == eager.dtype == torch.bfloat16
    assert torch.equal(from_graph, wide.to(torch.bfloat16)) and torch.equal(eager, wide.to(torch.bfloat16))
    assert emulator.is_device(from_graph) and emulator.is_device(eager)

    # As a script writes it too: the functional call with its bias as a keyword.
    keyword = emulator.graph(
        torch.compile(lambda x, w, b: F.conv2d(x, w, bias=b, padding=1), backend=counter, fullgraph=True), "keyword"
    )
    with torch.no_grad(), emulator.device_work():
        by_keyword = keyword(x, conv.weight, conv.bias)
    assert torch.equal(by_keyword, wide.to(torch.bfloat16))
    assert len(seen) == 2 and "accumulate_in_float32" in seen[1]
