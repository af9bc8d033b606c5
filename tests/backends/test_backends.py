"""Device backends: selection, the Neuron SDK's refusal, and cache-hit evidence."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from neuron_app.backends import resolve_backend
from neuron_app.backends.base import FolderCacheProbe
from neuron_app.backends.neuron import NeuronCacheProbe
from neuron_app.errors import DeviceUnavailable
from tests.neuron_fakes import FAKE_SDK, fake_sdk_on_path
from tests.support import ROOT


def test_auto_picks_cpu_here_and_points_inductor_cache_into_cache_dir(tmp_path: Path) -> None:
    backend = resolve_backend("auto", tmp_path)
    assert backend.name == "cpu"
    assert backend.torch_device() == "cpu" and backend.default_compile_backend == "inductor"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")


def test_neuron_without_sdk_refuses_with_install_hint(tmp_path: Path) -> None:
    """No torch-neuronx here: one line that says where to get it and how to pick another device."""
    with pytest.raises(DeviceUnavailable) as info:
        resolve_backend("neuron", tmp_path)
    message = str(info.value)
    assert "torch-neuronx==2.13.*" in message and "awsdocs-neuron.readthedocs-hosted.com" in message
    assert "NEURON_APP_DEVICE=cpu" in message and "\n" not in message


def test_neuron_cache_env_is_set_before_the_sdk_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a FAKE torch_neuronx (the real SDK cannot exist here), the NEFF folder is exported first."""
    monkeypatch.delenv("TORCH_NEURONX_NEFF_CACHE_DIR", raising=False)
    with fake_sdk_on_path(monkeypatch, FAKE_SDK):
        backend = resolve_backend("neuron", tmp_path)
        import torch_neuronx  # the fake

        folder = Path(torch_neuronx.NEFF_CACHE_AT_IMPORT)  # `neff/<the SDK's release and flags>` (T12)
        assert folder.parent == tmp_path / "neff" and folder.name.startswith("torch-neuronx-2.13.3.1-")
        assert backend.default_compile_backend == "neuron" and backend.dist_backend == "neuron"
        assert isinstance(backend.cache_probe("neuron", tmp_path), NeuronCacheProbe)


def test_the_neff_folder_is_keyed_by_sdk_release_and_compiler_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """T12: NEFFs of another SDK build, compiler flags, logical-core setting or SDPA lowering go to another folder,
    so TorchNeuron never meets them whatever its own disk key covers; the user's own folder is kept as it is."""
    from neuron_app.environment import neff_cache_dir

    for name in ("TORCH_NEURONX_NEFF_CACHE_DIR", "NEURON_CC_FLAGS", "NEURON_LOGICAL_NC_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    plain = neff_cache_dir(tmp_path)
    assert plain.parent == tmp_path / "neff" and plain.name.startswith("torch-neuronx-absent-")
    monkeypatch.setenv("NEURON_CC_FLAGS", "--optlevel 1")
    flagged = neff_cache_dir(tmp_path)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    assert len({plain, flagged, neff_cache_dir(tmp_path)}) == 3
    monkeypatch.delenv("NEURON_CC_FLAGS")
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG")
    with fake_sdk_on_path(monkeypatch, FAKE_SDK):  # a TorchNeuron build installed: its version names the folder
        assert neff_cache_dir(tmp_path).name.startswith("torch-neuronx-2.13.3.1-")
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(tmp_path / "mine"))
    assert neff_cache_dir(tmp_path) == tmp_path / "mine"


def test_neff_folder_probe_judges_disk_only_when_no_new_artifact(tmp_path: Path) -> None:
    probe = FolderCacheProbe(tmp_path)
    empty = probe.snapshot()
    (tmp_path / "MODULE_1").mkdir()
    (tmp_path / "MODULE_1" / "model.neff").write_bytes(b"x")
    first = probe.snapshot()
    assert probe.judge(empty, first) == "miss"  # a new NEFF was compiled
    assert probe.judge(first, probe.snapshot()) == "disk"  # nothing new: served from the cache


def test_unknown_device_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DeviceUnavailable, match="unknown device"):
        resolve_backend("tpu", tmp_path)


def test_importing_the_package_loads_no_heavy_library() -> None:
    """Start-up and the CLI stay fast, and torch-neuronx loads only when the neuron device is chosen."""
    import subprocess

    code = (
        "import sys, neuron_app, neuron_app.settings, neuron_app.engine.manager, neuron_app.web.server, "
        "neuron_app.scale.distributed, neuron_app.engine.cache.manifest, neuron_app.backends, neuron_app.__main__; "
        "print([m for m in ('torch', 'diffusers', 'transformers', 'gradio', 'torch_neuronx') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_on_neuron_a_transposed_shape_is_its_own_key_even_with_the_tiled_vae(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_settings: Any
) -> None:
    """CPU shares one transformer graph between 128x64 and 64x128. Neuron compiles eager ops per shape, and the
    glue around the tiled VAE (latent unpacking, de-normalisation, the tiler's slicing) runs at each resolution's
    own shape: the orientation stays in the key with the tiled VAE too (review S2), so `ready` means no compile of
    any kind. The token count, and with it the transformer graph, is still shared (FAKE SDK)."""
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.shapes import Resolution

    wide, tall = Resolution(128, 64), Resolution(64, 128)
    cpu = PipelineManager(make_settings())
    assert cpu.graph_key(wide) == cpu.graph_key(tall) and not cpu.vae_compiled

    with fake_sdk_on_path(monkeypatch, FAKE_SDK):
        managers = {}
        for vae_compile in ("auto", "off"):
            neuron = PipelineManager(make_settings(device="neuron", compile_backend=None, vae_compile=vae_compile))
            assert neuron.backend.name == "neuron" and neuron.compile_backend == "neuron"
            assert neuron.vae_compiled is (vae_compile == "auto")
            assert neuron.graph_key(wide) != neuron.graph_key(tall)
            assert neuron.graph_key(wide).image_tokens == neuron.graph_key(tall).image_tokens
            managers[vae_compile] = neuron
        # the tile is part of what a precompiled entry names
        assert managers["auto"].fingerprint != managers["off"].fingerprint


def test_host_glue_is_known_with_or_without_its_overload() -> None:
    """T9: TorchNeuron's fallback list may name ops without the overload (`aten::scatter_`); diffusers' latent
    unpack is host glue either way, while another overload of it, named, is a slow path."""
    from neuron_app.backends.fallbacks import degrading

    ops = ["aten::scatter_", "scatter_.src", "aten.scatter_.src", "aten::scatter_.value", "aten::index_put_"]
    assert degrading(ops) == ["aten::scatter_.value", "aten::index_put_"]


def test_compile_mode_auto_is_regional_on_neuron_and_full_elsewhere(make_settings: Any) -> None:
    """T8: nobody has compiled the whole 4B transformer as one neuronx-cc job, so Neuron (and the emulator, its
    code path) compiles per block class by default; a set mode is kept; the status and fingerprint say which."""
    from neuron_app.backends.neuron import NeuronBackend
    from neuron_app.engine.manager import PipelineManager

    assert make_settings().compile_mode == "auto" and NeuronBackend.default_compile_mode == "regional"
    emulated = PipelineManager(make_settings(device="neuron-emulated"))
    assert emulated.settings.compile_mode == "regional" == emulated.fingerprint_fields["compile_mode"]
    assert emulated.status().compile_mode == "regional"
    assert PipelineManager(make_settings()).settings.compile_mode == "full"  # cpu
    assert PipelineManager(make_settings(device="neuron-emulated", compile_mode="full")).settings.compile_mode == "full"
