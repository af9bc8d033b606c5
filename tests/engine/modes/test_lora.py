"""LoRA styles switched per request in the compiled tiny transformer, with no recompile.

Real adapters (`tiny:<seed>`: random LoRAs saved as .safetensors and loaded through diffusers'
`load_lora_weights`), the real peft slot, aot_eager compiles, the exact compile counter.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError
from PIL import Image

from tests.support import PATIENT_HTTP, ROOT, TINY_OVERRIDES, free_port, link_models, openai_client, page_generate

LORAS = {"red": "tiny:1", "blue": "tiny:2"}
PROMPT, SHAPE, STEPS, SEED = "a red barn in snow", "64x64", 2, 11


def pixels(record: Any) -> np.ndarray:
    return np.asarray(record.image, dtype=np.float64)


@pytest.fixture(scope="module")
def lora_manager(tmp_path_factory: pytest.TempPathFactory, shared_models: Path) -> Any:
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.settings import load_settings

    cache_dir = link_models(tmp_path_factory.mktemp("lora"), shared_models)
    manager = PipelineManager(load_settings(**(TINY_OVERRIDES | {"cache_dir": cache_dir, "loras": LORAS})))
    manager.ensure_loaded()
    return manager


@pytest.fixture(scope="module")
def styles(lora_manager: Any) -> dict[str, Any]:
    """One walk none -> red -> blue -> blue@0.5 -> red -> none, with the compile counter after each call."""
    walk = [("none", 1.0), ("red", 1.0), ("blue", 1.0), ("blue", 0.5), ("red", 1.0), ("none", 1.0)]
    records, compiles = [], []
    for lora, scale in walk:
        records.append(lora_manager.generate(PROMPT, SHAPE, STEPS, SEED, lora=lora, lora_scale=scale))
        compiles.append(lora_manager.status().compiles)
    return {"records": records, "compiles": compiles}


def test_switching_styles_and_scale_compiles_nothing_after_the_shapes_first_compile(styles: dict[str, Any]) -> None:
    records, compiles = styles["records"], styles["compiles"]
    assert compiles[0] >= 1 and records[0].compiled
    assert compiles == [compiles[0]] * len(compiles), "a LoRA or scale switch recompiled"
    assert [r.compiled for r in records[1:]] == [False] * 5
    assert [(r.lora, r.lora_scale) for r in records] == [
        ("none", 1.0),
        ("red", 1.0),
        ("blue", 1.0),
        ("blue", 0.5),
        ("red", 1.0),
        ("none", 1.0),
    ]
    assert records[1].lora_switch_s > 0 and records[2].lora_switch_s > 0  # a real switch happened


def test_the_swap_takes_effect_in_the_compiled_graph(styles: dict[str, Any]) -> None:
    """Different styles and scales give different images; the same style, scale and seed give the same image."""
    none, red, blue, blue_half, red_again, none_again = (pixels(r) for r in styles["records"])
    assert np.abs(red - none).mean() > 0.1
    assert np.abs(blue - red).mean() > 0.1
    assert np.abs(blue_half - blue).mean() > 0.1
    np.testing.assert_array_equal(red_again, red)
    np.testing.assert_array_equal(none_again, none)


def test_none_equals_a_server_without_loras(styles: dict[str, Any], module_manager: Any) -> None:
    from peft.tuners.lora import LoraLayer

    plain = module_manager.generate(PROMPT, SHAPE, STEPS, SEED)
    assert plain.lora == "none"
    # The plain server pays nothing for LoRA: no adapter layer, no LoRA field in its fingerprint.
    assert not any(isinstance(m, LoraLayer) for m in module_manager.pipe.transformer.modules())
    assert "lora" not in module_manager.fingerprint_fields and module_manager.status().loras == []
    np.testing.assert_allclose(pixels(styles["records"][0]), pixels(plain), atol=1.0)


def test_status_lists_adapters_and_fingerprint_covers_rank_not_compile_keys(lora_manager: Any) -> None:
    status = lora_manager.status()
    assert status.loras == [
        {"name": "red", "rank": 4, "source": "tiny:1"},
        {"name": "blue", "rank": 8, "source": "tiny:2"},
    ]
    assert lora_manager.fingerprint_fields["lora"]["target_rank"] == 64
    assert set(status.shapes) == set(TINY_OVERRIDES["resolutions"])


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"lora": "green"}, "LoRA style 'green' is not offered; choose one of none, red, blue"),
        ({"lora": 3}, "choose one of none, red, blue"),
        ({"lora": "red", "lora_scale": -0.1}, "lora_scale must be between 0 and 2"),
        ({"lora": "red", "lora_scale": 2.5}, "lora_scale must be between 0 and 2"),
        ({"lora": "red", "lora_scale": math.nan}, "lora_scale must be between 0 and 2"),
        ({"lora": "red", "lora_scale": "1"}, "lora_scale must be a number"),
    ],
)
def test_bad_lora_requests_are_refused_before_any_model_work(
    lora_manager: Any, options: dict[str, Any], fragment: str
) -> None:
    from neuron_app.errors import RequestError

    before = lora_manager.status()
    active = lora_manager.adapters.active
    with pytest.raises(RequestError, match=fragment):
        lora_manager.generate(PROMPT, "128x128", STEPS, SEED, **options)  # a shape never compiled here
    after = lora_manager.status()
    assert after.compiles == before.compiles and after.shapes["128x128"].state == "not_compiled"
    assert lora_manager.adapters.active == active


# --- start-up failures --------------------------------------------------------------------------------------
def _write_lora(path: Path, module: str, rank: int = 4, width: int = 32) -> Path:
    import torch
    from safetensors.torch import save_file

    save_file(
        {
            f"transformer.{module}.lora_A.weight": torch.zeros(rank, width),
            f"transformer.{module}.lora_B.weight": torch.zeros(width, rank),
        },
        str(path),
    )
    return path


def test_adapter_problems_stop_the_start_naming_the_adapter(make_settings: Callable[..., Any], tmp_path: Path) -> None:
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.errors import LoraError

    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x00\x01 not a safetensors file")
    high = _write_lora(tmp_path / "high.safetensors", "transformer_blocks.0.attn.to_q", rank=16)
    cases = [
        ({"x": str(tmp_path / "absent.safetensors")}, {}, "LoRA 'x': file .* does not exist"),
        ({"x": str(corrupt)}, {}, "LoRA 'x': .* is unreadable"),
        ({"x": str(high)}, {"max_lora_rank": 8}, "LoRA 'x': rank 16 is above max_lora_rank 8"),
        ({"x": "tiny:2"}, {"max_lora_rank": 4}, "LoRA 'x': rank 8 is above max_lora_rank 4"),
        ({"x": "tiny:one"}, {}, "tiny adapters are written tiny:<seed>"),
        ({"x": "not a source"}, {}, "neither an existing path, a Hub id"),
    ]
    for loras, extra, pattern in cases:
        with pytest.raises(LoraError, match=pattern):
            PipelineManager(make_settings(loras=loras, **extra))


def test_adapter_for_absent_modules_fails_the_load_naming_it(make_settings: Callable[..., Any], tmp_path: Path) -> None:
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.errors import LoraError

    alien = _write_lora(tmp_path / "alien.safetensors", "transformer_blocks.7.attn.to_q")
    manager = PipelineManager(make_settings(loras={"red": "tiny:1", "alien": str(alien)}))
    with pytest.raises(LoraError, match=r"LoRA 'alien': target modules absent .*transformer_blocks\.7\.attn\.to_q"):
        manager.ensure_loaded()
    assert manager.status().load_error.startswith("LoRA 'alien'")


def test_app_py_with_a_missing_adapter_exits_with_one_clear_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_APP_")}
    env |= {
        "NEURON_APP_MODEL": "tiny",
        "NEURON_APP_DEVICE": "cpu",
        "NEURON_APP_CACHE_DIR": str(tmp_path / "c"),
        "NEURON_APP_LORAS": '{"red": "tiny:1", "ink": "/nowhere/ink.safetensors"}',
        "NEURON_APP_SERVER_PORT": str(free_port()),  # 7860 may be taken: the port is checked first
    }
    done = subprocess.run(
        [sys.executable, str(ROOT / "app.py")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert "error: LoRA 'ink': file /nowhere/ink.safetensors does not exist" in done.stderr


# --- through gradio_client ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_app(launch_tiny: Callable[..., Any]) -> Any:
    return launch_tiny(loras=LORAS)


@pytest.fixture(scope="module")
def lora_client(lora_app: Any) -> Any:
    return Client(lora_app.url, verbose=False, httpx_kwargs=PATIENT_HTTP)


def test_four_argument_generate_still_works_and_styles_are_optional_inputs(lora_client: Any) -> None:
    path, info = lora_client.predict(PROMPT, SHAPE, STEPS, SEED, api_name="/generate")
    assert (info["lora"], info["lora_scale"]) == ("none", 1.0)
    compiles = lora_client.predict(api_name="/status")["compiles"]

    styled, info = lora_client.predict(PROMPT, SHAPE, STEPS, SEED, "blue", 0.75, api_name="/generate")
    assert (info["lora"], info["lora_scale"], info["cache"]) == ("blue", 0.75, "memory")
    status = lora_client.predict(api_name="/status")
    assert status["compiles"] == compiles
    assert [a["name"] for a in status["loras"]] == ["red", "blue"]
    with Image.open(styled) as image:
        assert image.text["lora"] == "blue" and image.text["lora_scale"] == "0.75"
    with Image.open(path) as plain, Image.open(styled) as image:
        assert np.abs(np.asarray(plain, dtype=float) - np.asarray(image, dtype=float)).mean() > 0.1

    with pytest.raises(AppError, match="LoRA style 'sepia' is not offered; choose one of none, red, blue"):
        lora_client.predict(PROMPT, SHAPE, STEPS, SEED, "sepia", 1.0, api_name="/generate")
    with pytest.raises(AppError, match="lora_scale must be between 0 and 2"):
        lora_client.predict(PROMPT, SHAPE, STEPS, SEED, "red", 3, api_name="/generate")
    assert lora_client.predict(api_name="/status")["compiles"] == compiles


def test_openai_api_takes_lora_and_lora_scale_as_extensions(lora_app: Any, lora_client: Any) -> None:
    """The OpenAI SDK's `extra_body` carries the style; the image equals the Gradio API's for the same inputs;
    an unknown style or scale is a 400 naming the field; nothing compiles for any of it."""
    import base64
    import io

    import openai

    api = openai_client(lora_app)
    lora_client.predict(PROMPT, SHAPE, STEPS, SEED, api_name="/generate")  # the shape is compiled
    compiles = lora_app.manager.status().compiles
    extra = {"seed": SEED, "num_inference_steps": STEPS, "lora": "red", "lora_scale": 1.5}
    result = api.images.generate(prompt=PROMPT, size=SHAPE, extra_body=extra)
    provenance = result.data[0].model_extra["provenance"]
    assert (provenance["lora"], provenance["lora_scale"]) == ("red", 1.5)
    path, _info = lora_client.predict(PROMPT, SHAPE, STEPS, SEED, "red", 1.5, api_name="/generate")
    with Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))) as got, Image.open(path) as expected:
        assert got.convert("RGB").tobytes() == expected.convert("RGB").tobytes()
    for fields, param, message in [
        ({"lora": "sepia"}, "lora", "LoRA style 'sepia' is not offered; choose one of none, red, blue"),
        ({"lora": "red", "lora_scale": 9}, "lora_scale", "lora_scale must be between 0 and 2"),
    ]:
        with pytest.raises(openai.BadRequestError) as caught:
            api.images.generate(prompt=PROMPT, size="128x128", extra_body=fields)
        assert caught.value.body["param"] == param and message in caught.value.body["message"]
    assert lora_app.manager.status().compiles == compiles


def test_the_page_sends_the_style_dropdown_and_scale_slider(lora_app: Any) -> None:
    """The page's Generate event carries the style and scale to the manager (info line says so); a style the
    dropdown does not list is refused by Gradio before the app runs."""

    message = page_generate(lora_app, [PROMPT, SHAPE, STEPS, SEED, 1, False], style=("red", 0.5))
    assert message["success"] is True, message
    assert "LoRA red x0.5" in message["output"]["data"][1]
    refused = page_generate(lora_app, [PROMPT, SHAPE, STEPS, SEED, 1, False], style=("sepia", 1.0))
    assert refused["success"] is False and "sepia" in refused["output"]["error"]


def test_fingerprint_follows_rank_and_targets_not_weights(make_settings: Callable[..., Any], tmp_path: Path) -> None:
    """Precompiled shapes stay valid when an adapter's weights change, not when the slot's rank or targets do."""
    from neuron_app.engine.manager import PipelineManager

    def fingerprint(**overrides: Any) -> str:
        return PipelineManager(make_settings(**overrides)).fingerprint

    plain = fingerprint()
    red = fingerprint(loras={"red": "tiny:1"})
    assert red != plain
    assert fingerprint(loras={"other": "tiny:3"}) == red  # other weights, same shapes
    assert fingerprint(loras={"red": "tiny:1"}, max_lora_rank=32) != red
    q = _write_lora(tmp_path / "q.safetensors", "transformer_blocks.0.attn.to_q")
    q_again = _write_lora(tmp_path / "q2.safetensors", "transformer_blocks.0.attn.to_q", rank=2)
    k = _write_lora(tmp_path / "k.safetensors", "transformer_blocks.0.attn.to_k")
    assert fingerprint(loras={"a": str(q)}) == fingerprint(loras={"b": str(q_again)})
    assert fingerprint(loras={"a": str(q)}) != fingerprint(loras={"a": str(k)})


def test_a_shipped_models_style_is_a_lora_source() -> None:
    """`tiny-shapes:outline` is the shipped style's file; a style it does not ship is refused by name."""
    from neuron_app.engine.modes.lora import AdapterSpec
    from neuron_app.errors import LoraError
    from neuron_app.settings import shipped_model

    spec = AdapterSpec.parse("outline", "tiny-shapes:outline")
    assert spec.kind == "file" and spec.location == str(shipped_model("tiny-shapes") / "lora" / "outline.safetensors")
    with pytest.raises(LoraError, match="ships no style 'glow'"):
        AdapterSpec.parse("glow", "tiny-shapes:glow")
