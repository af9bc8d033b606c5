"""tiny-shapes draws what it is asked: every mode of the pipeline judged by what its images show (the judge reads
the background from the border, the shape from the pixels far from it: neuron_app/engine/model/shapes_world.py).

Each test names what would break it; each was checked by breaking that thing on purpose (docs/tiny-shapes.md).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from PIL import Image

from neuron_app.engine.manager import PipelineManager
from neuron_app.engine.model.shapes_world import EVAL_SCENES, Scene, judge, render
from tests.support import SHAPES_OVERRIDES, png

#: The shape kind the judge must read right, of the 12 prompts, on each device (the issue's bar).
SHAPES_AT_LEAST = 9


@pytest.fixture(scope="module", params=["cpu", "neuron-emulated"])
def drawn(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> PipelineManager:
    """A tiny-shapes manager on each device the tests run (neuron-emulated: the neuron code path on CPU)."""
    from neuron_app.settings import load_settings

    overrides = SHAPES_OVERRIDES | {"cache_dir": tmp_path_factory.mktemp("shapes"), "device": request.param}
    manager = PipelineManager(load_settings(**overrides))
    manager.ensure_loaded()
    return manager


def _score(manager: PipelineManager, scenes: tuple[Scene, ...], shape: str, steps: int = 4) -> dict[str, int]:
    counts = {"background": 0, "colour": 0, "shape": 0, "position": 0, "both_colours": 0}
    for i, scene in enumerate(scenes):
        reading = judge(manager.generate(scene.prompt, shape, steps, 100 + i).image)
        right = reading.matches(scene)
        for key, ok in right.items():
            counts[key] += ok
        counts["both_colours"] += right["colour"] and right["background"]
    return counts


def test_twelve_prompts_at_128x128_in_four_steps(drawn: PipelineManager) -> None:
    """Breaks if the prompt does not reach the transformer (a wrong text layer, truncation), or the VAE is off:
    with the conditioning lost, both colours are right by chance in 1 of 56. The issue's bar: both colours in at
    least 11 of 12, the shape in at least 9 (docs/tiny-shapes.md has the shipped model's counts)."""
    counts = _score(drawn, EVAL_SCENES, "128x128")
    print(drawn.settings.device, counts)
    assert counts["both_colours"] >= 11 and counts["position"] >= 11, counts
    assert counts["shape"] >= SHAPES_AT_LEAST, counts


def test_wide_and_tall_shapes_follow_the_position(drawn: PipelineManager) -> None:
    """256x128 and 128x256 draw the asked colours where the prompt says: `on the right` of a wide image lands in
    its right part. Breaks if the position words do not reach the transformer, or the ids of a non-square latent
    grid are built in the wrong order (a wide image's `left` read as `top`)."""
    cases = [
        (Scene("red", "circle", "white", "right"), "256x128"),
        (Scene("blue", "square", "yellow", "left"), "256x128"),
        (Scene("green", "circle", "black", "top"), "128x256"),
        (Scene("orange", "square", "blue", "bottom"), "128x256"),
    ]
    right = 0
    for scene, shape in cases:
        reading = judge(drawn.generate(scene.prompt, shape, 4, 5).image)
        print(shape, scene.position, "->", reading.position, reading.colour, reading.background, reading.shape)
        verdict = reading.matches(scene)
        right += verdict["colour"] and verdict["background"] and verdict["position"]
    assert right == len(cases), right


def test_inpaint_draws_inside_the_mask_and_keeps_the_rest(drawn: PipelineManager) -> None:
    """A left-half mask and `a blue circle ... on the left`: blue inside the mask, the source's right half kept."""
    source = render(Scene("yellow", "square", "green", "right"), 128, 128)
    alpha = np.full((128, 128), 255, np.uint8)
    alpha[:, :64] = 0  # OpenAI's rule: transparent = edit
    mask = png(Image.fromarray(np.dstack([np.zeros((128, 128, 3), np.uint8), alpha]), "RGBA"))
    drawn.compile_shape("128x128")  # ready whichever test ran first: the inpaint must add no graph to it
    before = drawn.status().compiles
    out = drawn.generate(
        "a blue circle on a green background on the left", "128x128", 4, 3, image=png(source), mask=mask
    )
    pixels = np.asarray(out.image.convert("RGB")).astype(np.int16)
    kept = np.asarray(source).astype(np.int16)[:, 64:]
    assert np.array_equal(pixels[:, 64:], kept)  # outside the mask: the source exactly
    left = judge(Image.fromarray(pixels[:, :56].astype(np.uint8)))
    assert left.colour == "blue", left
    assert judge(Image.fromarray(pixels[:, 72:].astype(np.uint8))).colour == "yellow"
    assert drawn.status().compiles == before  # the text-to-image graph


def test_image_to_image_strength_moves_away_from_the_source(drawn: PipelineManager) -> None:
    """The distance to the source grows with `strength`; at low strength the source's colours stay. At 8 steps:
    strength 0.125 runs the last one (klein's shifted schedule puts even that at sigma ~0.5; at 4 steps the last
    step is at ~0.7, where the prompt already wins)."""
    scene = Scene("red", "circle", "blue")
    source = render(scene, 128, 128)
    prompt = "a yellow triangle on a black background"
    distances = []
    for strength in (0.125, 0.5, 1.0):
        out = drawn.generate(prompt, "128x128", 8, 11, image=png(source), strength=strength).image
        distances.append(float(np.abs(np.asarray(out, np.float32) - np.asarray(source, np.float32)).mean()))
        if strength == 0.125:
            low = judge(out)
            assert (low.colour, low.background) == ("red", "blue"), low
        if strength == 1.0:
            assert judge(out).matches(Scene("yellow", "triangle", "black"))["colour"]
    assert distances[0] < distances[1] < distances[2], distances


def test_edit_recolours_and_keeps_the_references_shape_background_and_place(drawn: PipelineManager) -> None:
    """`make the triangle red` with a reference: the new colour, and the reference's shape, background and place.
    The prompt names neither the background nor the place, so those can only come from the reference (and with a
    circle as the reference the same prompt gives a red circle): breaks if the reference's tokens (or their ids) do
    not reach the transformer, or the recolour word is lost."""
    reference = render(Scene("blue", "triangle", "white", "left"), 128, 128)
    out = drawn.generate("make the triangle red", "128x128", 4, 1, references=[png(reference)]).image
    reading = judge(out)
    assert (reading.colour, reading.shape, reading.background, reading.position) == (
        "red",
        "triangle",
        "white",
        "left",
    ), reading


def test_outline_style_shows_when_on_and_not_when_off(drawn: PipelineManager) -> None:
    """The shipped `outline` LoRA (tiny-shapes:outline) at scale 1.0 turns the filled green square into a green
    outline, in the same compiled graph; `none` gives the filled square back exactly. Breaks if the adapter is not
    applied (or applied at scale 0), or a switch recompiles."""
    prompt, shape = "a green square on a white background", "128x128"
    drawn.generate(prompt, shape, 4, 4)  # the graph is ready
    before = drawn.status().compiles
    plain_image = drawn.generate(prompt, shape, 4, 4, lora="none").image
    styled_image = drawn.generate(prompt, shape, 4, 4, lora="outline", lora_scale=1.0).image
    again_image = drawn.generate(prompt, shape, 4, 4, lora="none").image
    plain, styled = judge(plain_image), judge(styled_image)
    print("outline style:", styled)
    change = np.abs(np.asarray(styled_image, np.float32) - np.asarray(plain_image, np.float32)).mean()
    assert change > 3.0, change  # visible
    assert styled.outline and not plain.outline, (plain, styled)
    assert (plain.colour, plain.background) == (styled.colour, styled.background) == ("green", "white"), styled
    assert np.array_equal(np.asarray(again_image), np.asarray(plain_image))
    assert drawn.status().compiles == before


def test_the_last_preview_names_the_final_images_colours(drawn: PipelineManager) -> None:
    """The live preview after the last step shows what the decode then shows: the same background and shape colour
    read by the judge. Breaks if the previews use a map that is not this VAE's (without the model's
    preview_rgb.json they fall back to gray: 0 of 6), or unpack the tokens in the wrong order."""
    from dataclasses import replace

    from neuron_app.engine.modes.previews import PreviewEvent

    same = 0
    for i, scene in enumerate(EVAL_SCENES[:6]):
        events: list[Any] = []
        record = drawn.run(replace(drawn.validate(scene.prompt, "128x128", 4, 100 + i), previews=True), events.append)
        last = [e for e in events if isinstance(e, PreviewEvent)][-1].preview
        preview, final = judge(last), judge(record.image)
        print(scene.prompt, "preview:", preview.background, preview.colour, "image:", final.background, final.colour)
        same += (preview.background, preview.colour) == (final.background, final.colour)
    assert same == 6, same


def _psnr(a: Any, b: Any) -> float:
    mse = float(((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def test_tiled_vae_against_the_whole_decode(tmp_path_factory: pytest.TempPathFactory) -> None:
    """PSNR of the tiled decode against the whole decode on the trained VAE, per tile size at the default overlap;
    the seam question in numbers (docs/compiling-less.md)."""
    import torch

    from neuron_app.engine.model.vae import TiledDecoder, TileSpec
    from neuron_app.settings import load_settings

    settings = load_settings(**SHAPES_OVERRIDES | {"cache_dir": tmp_path_factory.mktemp("tiles")})
    manager = PipelineManager(settings)
    pipe = manager.ensure_loaded()
    image = render(Scene("orange", "circle", "purple", "left", "large"), 256, 256)
    with torch.inference_mode():
        x = pipe.image_processor.preprocess(image, height=256, width=256)
        z = pipe.vae.encode(x).latent_dist.mode()
        whole = pipe.image_processor.postprocess(pipe.vae.decode(z).sample)[0]
        results = {}
        for tile in (8, 16, 24):
            tiled = TiledDecoder(pipe.vae, TileSpec(tile, min(8, tile // 2) if tile > 8 else 2))
            results[tile] = _psnr(whole, pipe.image_processor.postprocess(tiled.decode(z).sample)[0])
    print("tiled-VAE PSNR (dB) by latent tile:", results)
    assert _psnr(whole, image) > 20  # the trained VAE reconstructs the scene
    assert results[24] >= results[8] - 1e-6 and results[16] > 30, results


def test_the_cut_text_encoder_gives_the_same_images(drawn: PipelineManager) -> None:
    """The served pipeline's encoder is cut after the last layer klein reads (27: here every layer, so the final
    norm stays); the same prompt and seed through the uncut pipeline from the same folder give the same picture."""
    import torch
    from diffusers import Flux2KleinPipeline

    from neuron_app.settings import shipped_model

    if drawn.settings.device != "cpu":
        pytest.skip("neuron-emulated computes in bfloat16: the float32 reference is not the same computation")
    full = Flux2KleinPipeline.from_pretrained(shipped_model("tiny-shapes"))
    full.set_progress_bar_config(disable=True)
    assert not isinstance(full.text_encoder.model.norm, torch.nn.Identity)
    prompt = "a black triangle on a orange background"
    with torch.inference_mode():
        reference = full(
            prompt=prompt,
            width=128,
            height=128,
            num_inference_steps=4,
            guidance_scale=1.0,
            max_sequence_length=32,
            generator=torch.Generator().manual_seed(9),
        ).images[0]
    served = drawn.generate(prompt, "128x128", 4, 9).image
    diff = np.abs(np.asarray(served, np.int16) - np.asarray(reference, np.int16))
    assert diff.mean() < 1.5, diff.mean()  # compiled vs eager: float rounding only
    assert judge(served) == judge(reference)
