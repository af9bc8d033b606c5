"""Inpainting, image-to-image and live previews on the real tiny pipeline: the text-to-image graph, no new compile."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from PIL import Image

from neuron_app.engine.manager import PipelineManager
from neuron_app.errors import RequestError
from tests.support import PICTURE_SIZE as SIZE
from tests.support import halves, left_half_mask, png, source_image


@pytest.fixture(scope="module")
def manager(module_manager: Any) -> PipelineManager:
    module_manager.generate("warm", f"{SIZE}x{SIZE}", 2, 0)  # the text-to-image graph of this shape
    return module_manager


def test_inpaint_keeps_the_unmasked_half_and_compiles_nothing(manager: PipelineManager) -> None:
    before = manager.status().compiles
    source = source_image()
    src_left, src_right = halves(source)
    lefts = []
    for prompt, seed in (("a red door", 1), ("a mountain lake", 7)):
        record = manager.generate(prompt, f"{SIZE}x{SIZE}", 2, seed, image=png(source), mask=left_half_mask())
        left, right = halves(record.image)
        assert np.array_equal(right, src_right)  # outside the mask: the input's pixels exactly
        assert np.abs(left - src_left).mean() > 10  # the masked half is new
        assert record.source is not None and record.source["masked"] and record.source["strength"] == 1.0
        assert record.source["edit_fraction"] == 0.5 and record.info()["source"] == record.source
        lefts.append(left)
    assert not np.array_equal(lefts[0], lefts[1])
    assert manager.status().compiles == before  # the text-to-image graph served both


def test_a_white_on_black_mask_reads_white_as_edit(manager: PipelineManager) -> None:
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[:, : SIZE // 2] = 255
    record = manager.generate(
        "a red door", f"{SIZE}x{SIZE}", 2, 1, image=png(source_image()), mask=png(Image.fromarray(mask, "L"))
    )
    assert np.array_equal(halves(record.image)[1], halves(source_image())[1])


def test_image_to_image_strength(manager: PipelineManager) -> None:
    """Strength 1 is text-to-image exactly (the image is fully noised); low strength stays near the input."""
    source, shape = png(source_image()), f"{SIZE}x{SIZE}"
    text_only = np.asarray(manager.generate("a fox", shape, 4, 3).image)
    full = np.asarray(manager.generate("a fox", shape, 4, 3, image=source, strength=1.0).image)
    assert np.array_equal(full, text_only)
    # The tiny VAE is random: compare with the source as the VAE gives it back (no denoising at all).
    diffs = {}
    for strength in (0.25, 0.5, 1.0):
        out = np.asarray(manager.generate("a fox", shape, 4, 3, image=source, strength=strength).image)
        diffs[strength] = float(np.abs(out.astype(np.int16) - text_only.astype(np.int16)).mean())
    print("mean abs diff vs strength 1:", diffs)
    assert diffs[1.0] == 0.0 and diffs[0.25] > diffs[1.0]


def test_image_to_image_low_strength_stays_close_to_the_input(module_manager: PipelineManager) -> None:
    """Measured against the VAE's own round trip of the source (what 'no change' decodes to)."""
    import torch

    pipe = module_manager.ensure_loaded()
    source = source_image()
    with torch.inference_mode():
        tensor = pipe.image_processor.preprocess(source, height=SIZE, width=SIZE)
        latents = pipe.vae.encode(tensor).latent_dist.mode()
        round_trip = np.asarray(pipe.image_processor.postprocess(pipe.vae.decode(latents).sample)[0]).astype(np.int16)
    diffs = {}
    for strength in (0.25, 0.5, 0.75, 1.0):
        out = module_manager.generate("a fox", f"{SIZE}x{SIZE}", 4, 3, image=png(source), strength=strength).image
        diffs[strength] = float(np.abs(np.asarray(out).astype(np.int16) - round_trip).mean())
    print("mean abs diff vs the source's VAE round trip:", diffs)
    assert diffs[0.25] < diffs[1.0] and diffs[0.25] <= diffs[0.5] + 1e-9


def test_previews_per_step_without_compiling(manager: PipelineManager) -> None:
    from dataclasses import replace

    from neuron_app.engine.modes.previews import PreviewEvent, preview_size

    before = manager.status().compiles
    events: list[Any] = []
    request = replace(manager.validate("a fox", "128x64", 3, 1), previews=True)
    manager.generate("warm", "128x64", 1, 0)  # compile 128x64 first
    compiled = manager.status().compiles
    manager.run(request, progress=events.append)
    previews = [e for e in events if isinstance(e, PreviewEvent)]
    assert [e.step for e in previews] == [1, 2, 3]
    assert all(e.preview.size == preview_size(128, 64) == (32, 16) for e in previews)
    assert manager.status().compiles == compiled >= before
    plain: list[Any] = []
    manager.generate("a fox", "128x64", 3, 1, progress=plain.append)
    assert not any(isinstance(e, PreviewEvent) for e in plain)  # off unless asked


def _bomb() -> bytes:
    return png(Image.new("L", (5000, 5000)))


@pytest.mark.parametrize(
    ("mask", "words"),
    [
        (lambda: png(Image.new("L", (32, 32), 255)), "must be the image's size"),
        (lambda: left_half_mask()[:60], "not a readable image"),
        (lambda: b"not an image at all", "not a readable image"),
        (_bomb, "too many pixels"),
        (lambda: png(Image.new("L", (SIZE, SIZE), 0)), "marks nothing to edit"),
    ],
)
def test_hostile_masks_are_refused_before_any_work(make_settings: Any, mask: Any, words: str) -> None:
    manager = PipelineManager(make_settings(max_reference_pixels=4_000_000))
    with pytest.raises(RequestError, match=words) as caught:
        manager.generate("a fox", f"{SIZE}x{SIZE}", 2, 1, image=png(source_image()), mask=mask())
    assert caught.value.param == "mask"
    assert not manager.loaded and manager.status().compiles == 0


@pytest.mark.parametrize(
    ("options", "param", "words"),
    [
        ({"mask": "x"}, "mask", "needs the image"),
        ({"strength": 0.5}, "strength", "needs an image"),
        ({"image": "IMG", "strength": 0.0}, "strength", "runs no step"),
        ({"image": "IMG", "strength": 1.5}, "strength", "between 0 and 1"),
        ({"image": b"junk"}, "image", "not a readable image"),
    ],
)
def test_bad_sources_are_refused(make_settings: Any, options: dict[str, Any], param: str, words: str) -> None:
    manager = PipelineManager(make_settings())
    options = {k: png(source_image()) if v == "IMG" else v for k, v in options.items()}
    with pytest.raises(RequestError, match=words) as caught:
        manager.validate("a fox", f"{SIZE}x{SIZE}", 2, 1, **options)
    assert caught.value.param == param


def test_auto_resolution_follows_the_image(make_settings: Any) -> None:
    manager = PipelineManager(make_settings())
    wide = source_image(128).resize((256, 128))
    request = manager.validate("a fox", "auto", 2, 1, image=png(wide), strength=0.5)
    assert str(request.resolution) == "128x64" and request.source.image.size == (128, 64)


def test_preview_projects_the_unpacked_latents() -> None:
    """The preview of packed latents is FLUX.2's latent-to-RGB map applied to the unpacked 32-channel latents."""
    import torch
    from diffusers import Flux2KleinPipeline

    from neuron_app.engine.modes.previews import FLUX2_RGB, FLUX2_RGB_BIAS, latent_preview

    rows, cols = 4, 6
    latents = torch.randn(1, 32, rows * 2, cols * 2, generator=torch.Generator().manual_seed(0))
    packed = Flux2KleinPipeline._pack_latents(Flux2KleinPipeline._patchify_latents(latents))
    preview = latent_preview(packed, cols * 16, rows * 16)
    rgb = torch.einsum("chw,cr->hwr", latents[0], torch.tensor(FLUX2_RGB)) + torch.tensor(FLUX2_RGB_BIAS)
    expected = Image.fromarray(((rgb.clamp(-1, 1) + 1) * 127.5 + 0.5).numpy().astype(np.uint8), "RGB")
    assert preview.size == (cols * 4, rows * 4)
    assert np.array_equal(np.asarray(preview), np.asarray(expected.resize(preview.size, Image.Resampling.BILINEAR)))


def test_brush_strokes_are_the_mask() -> None:
    """The page's ImageEditor value: painted pixels (any layer's alpha) are what to redraw; no strokes is
    image-to-image at the slider's strength."""
    from neuron_app.web.page.inpaint import editor_source

    background = source_image().convert("RGBA")
    layer = Image.new("RGBA", background.size, (0, 0, 0, 0))
    layer.paste((255, 255, 255, 255), (0, 0, SIZE // 2, SIZE))
    options = editor_source({"background": background, "layers": [layer], "composite": None}, 0.8)
    assert options["strength"] == 0.8 and options["image"].mode == "RGB"
    mask = np.asarray(options["mask"])
    assert mask[:, : SIZE // 2].min() == 255 and mask[:, SIZE // 2 :].max() == 0
    blank = Image.new("RGBA", background.size, (0, 0, 0, 0))
    assert set(editor_source({"background": background, "layers": [blank]}, 0.5)) == {"image", "strength"}
    assert editor_source({"background": None, "layers": []}, 1.0) == {}
    assert editor_source(None, 1.0) == {}
