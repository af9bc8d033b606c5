"""Compiling less: one tiled VAE graph for every shape, token families sharing everything, and the
prompt-embedding cache. All on the real tiny FLUX.2-klein (random weights), on CPU."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from neuron_app.engine.cache.prompt_cache import PromptCache
from neuron_app.engine.manager import PipelineManager
from neuron_app.engine.model.vae import TileSpec
from neuron_app.engine.records import CacheResult, ShapeState
from tests.support import ROOT

#: Tiled vs whole decode must agree above this. 30 dB is an RMS error of 3 % of the pixel range (about
#: 8 levels of 255), the usual bar for "visually the same" in lossy image coding (JPEG at quality 75 sits
#: at 30 to 35 dB). The tiny VAE is a harsh case: random weights, GroupNorm with ONE group (statistics
#: over the whole tile) and a mid-block attention spanning the tile, so a tile sees different statistics
#: than the whole latent; the real VAE's 32 groups and trained weights are gentler. For scale, two
#: unrelated images of this model (another seed) score about 16 dB.
PSNR_THRESHOLD_DB = 30.0


def psnr(a: Any, b: Any) -> float:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    mse = float(np.mean(((x - y) / 255.0) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1 / mse)


def test_tile_origins_are_fixed_size_and_cover_the_latent() -> None:
    spec = TileSpec(8, 2)
    assert spec.starts(8) == [0]
    assert spec.starts(4) == [0]  # padded up to the tile
    assert spec.starts(16) == [0, 6, 8]  # the last tile ends at the edge: same shape, no smaller tile
    assert spec.starts(21) == [0, 6, 12, 13]
    for length in range(9, 60):
        starts = spec.starts(length)
        assert starts[-1] + 8 == length and all(b - a <= 6 for a, b in itertools.pairwise(starts))
    with pytest.raises(ValueError, match="overlap"):
        TileSpec(8, 5)


def test_tiled_decode_matches_the_whole_decode(make_settings: Any, shared_models: Path) -> None:
    """tiny-deep at 256x128 (a 32x16 latent in three 16x16 tiles): tiled and compiled vs the pipeline's decode."""
    from neuron_app.engine.model.tiny import ensure_tiny

    ensure_tiny(shared_models, "tiny-deep")
    common = {"model": "tiny-deep", "compile_mode": "eager", "resolutions": ["256x128"]}
    common |= {"default_resolution": "256x128", "default_steps": 1}  # the compile step runs default_steps
    plain = PipelineManager(make_settings(**common, vae_compile="off"))
    tiled = PipelineManager(make_settings(**common, vae_compile="on", vae_tile=16, vae_tile_overlap=4))
    whole = plain.generate("a red fox in the snow", "256x128", 2, 7).image
    other_seed = plain.generate("a red fox in the snow", "256x128", 2, 8).image
    record = tiled.generate("a red fox in the snow", "256x128", 2, 7)
    decoder = tiled.pipe.vae.decode.__self__
    assert decoder.tiles_decoded == 3 * 2  # compile step + request, three tiles each
    assert tiled.status().vae_compiles == 1 and plain.status().vae_compiles == 0
    quality = psnr(whole, record.image)
    assert math.isfinite(quality), "the tiled path must really be a different computation"
    assert quality > PSNR_THRESHOLD_DB, f"tiled decode PSNR {quality:.1f} dB"
    assert psnr(whole, other_seed) < PSNR_THRESHOLD_DB - 10  # the metric tells different images apart


def test_a_token_family_shares_every_graph_with_the_tiled_vae(make_settings: Any) -> None:
    """128x64 and 64x128 (32 tokens): the second compiles nothing, counted exactly; 1 VAE graph for all."""
    manager = PipelineManager(make_settings(vae_compile="on", vae_tile=8, vae_tile_overlap=2, default_steps=1))
    first = manager.generate("fox", "128x64", 1, 0)
    status = manager.status()
    assert (status.compiles, status.vae_compiles) == (2, 1)  # the transformer's graph and the tile graph
    assert first.compiled and first.graphs_compiled == 2
    assert status.shapes["64x128"].state is ShapeState.READY and status.shapes["64x128"].shared_with == "128x64"

    second = manager.generate("fox", "64x128", 1, 0)
    assert manager.status().compiles == 2  # exact: not one more graph, VAE included
    assert second.cache is CacheResult.MEMORY and not second.compiled
    assert np.asarray(second.image).shape == (128, 64, 3)

    manager.generate("fox", "128x128", 1, 0)  # a new family: its transformer graph only
    manager.generate("fox", "64x64", 1, 0)  # an 8x8 latent: exactly one tile
    status = manager.status()
    assert (status.compiles, status.vae_compiles) == (4, 1)


def test_vae_compile_auto_is_on_for_neuron_only() -> None:
    from neuron_app.backends import get_backend
    from neuron_app.engine.model.vae import vae_compiled

    tiled = {name: vae_compiled("auto", get_backend(name).tiles_vae_by_default) for name in ("neuron", "cpu", "cuda")}
    assert tiled == {"neuron": True, "cpu": False, "cuda": False}
    assert get_backend("neuron-emulated").tiles_vae_by_default
    assert vae_compiled("on", False) and not vae_compiled("off", True)


def test_prompt_cache_skips_the_encoder_and_keeps_images_identical(make_settings: Any) -> None:
    cached = PipelineManager(make_settings(compile_mode="eager", default_steps=1))
    uncached = PipelineManager(make_settings(compile_mode="eager", default_steps=1, prompt_cache_size=0))
    encoder_calls = []
    pipe = cached.ensure_loaded()
    handle = pipe.text_encoder.register_forward_hook(lambda *_: encoder_calls.append(1))
    try:
        images = [cached.generate("a lighthouse at dusk", "64x64", 2, seed).image for seed in (1, 2, 3)]
        assert len(encoder_calls) == 1  # seeds 2 and 3 reused seed 1's embeddings
        cached.generate("another prompt", "64x64", 2, 1)
        assert len(encoder_calls) == 2
    finally:
        handle.remove()
    assert cached.status().prompt_cache == {"hits": 2, "misses": 2, "entries": 2, "size": 64}
    for seed, image in zip((1, 2, 3), images, strict=True):
        reference = uncached.generate("a lighthouse at dusk", "64x64", 2, seed).image
        assert np.array_equal(np.asarray(image), np.asarray(reference))  # bit-identical
    assert uncached.status().prompt_cache["hits"] == 0


def test_prompt_cache_is_lru_and_keyed_on_length_and_model(make_settings: Any) -> None:
    manager = PipelineManager(make_settings(compile_mode="eager"))
    pipe = manager.ensure_loaded()
    cache = PromptCache(2, "model-a")
    a32 = cache.embeds(pipe, "a", 32)
    cache.embeds(pipe, "b", 32)
    assert cache.embeds(pipe, "a", 32) is a32  # hit: "a" becomes the most recent
    cache.embeds(pipe, "c", 32)  # evicts "b", the least recently used
    assert cache.embeds(pipe, "a", 32) is a32
    assert cache.embeds(pipe, "a", 16).shape[1] == 16  # another length is another entry
    assert cache.snapshot() == {"hits": 2, "misses": 4, "entries": 2, "size": 2}
    assert PromptCache(2, "model-b").embeds(pipe, "a", 32) is not a32


def test_prompt_cache_counts_user_prompts_only(make_settings: Any) -> None:
    """A compile runs the pipeline once with the warm-up prompt: that run is neither a hit nor a miss nor an
    entry, so one click with one prompt reads 0 hits, 1 miss."""
    manager = PipelineManager(make_settings(default_steps=1))  # aot_eager: the compile runs the pipeline
    record = manager.generate("one prompt", "64x64", 1, 0)
    assert record.compiled
    assert manager.status().prompt_cache == {"hits": 0, "misses": 1, "entries": 1, "size": 64}
    manager.generate("one prompt", "64x64", 1, 1)
    assert manager.status().prompt_cache == {"hits": 1, "misses": 1, "entries": 1, "size": 64}


def test_the_page_is_built_before_torch_is_imported(tmp_path: Path) -> None:
    """What app.py does before `launch`: settings, manager (device auto), the Blocks; none of it imports torch."""
    import subprocess
    import sys

    from neuron_app.backends.cuda import _nvidia_driver_present

    if _nvidia_driver_present():
        pytest.skip("with an NVIDIA driver, device auto asks torch whether CUDA works")
    code = (
        "import sys; from neuron_app.settings import load_settings; "
        "from neuron_app.web.server import build_app, prepare_environment; "
        f"s = load_settings(model='tiny', device='auto', cache_dir={str(tmp_path)!r}); prepare_environment(s); "
        "from neuron_app.engine.manager import PipelineManager; m = PipelineManager(s); build_app(s, m); "
        "print(m.backend.name, [n for n in ('torch', 'diffusers', 'transformers') if n in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[-2].endswith("[]"), out.stdout
