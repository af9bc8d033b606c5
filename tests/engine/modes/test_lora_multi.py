"""Several LoRA styles at once: one compiled slot per position, filled or zeroed per request, no recompile.

Real `tiny:<seed>` adapters in the real peft slots of the compiled tiny transformer (aot_eager)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support import TINY_OVERRIDES, link_models

LORAS = {"red": "tiny:1", "blue": "tiny:2", "green": "tiny:3"}
PROMPT, SHAPE, STEPS, SEED = "a red barn in snow", "64x64", 2, 11


def pixels(record: Any) -> np.ndarray:
    return np.asarray(record.image, dtype=np.float64)


@pytest.fixture(scope="module")
def multi_manager(tmp_path_factory: pytest.TempPathFactory, shared_models: Path) -> Any:
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.settings import load_settings

    cache_dir = link_models(tmp_path_factory.mktemp("lora-multi"), shared_models)
    settings = load_settings(**(TINY_OVERRIDES | {"cache_dir": cache_dir, "loras": LORAS, "max_loras_per_request": 2}))
    manager = PipelineManager(settings)
    manager.ensure_loaded()
    return manager


@pytest.fixture(scope="module")
def walk(multi_manager: Any) -> dict[str, Any]:
    """none, red, blue, red+blue, blue+red, red+blue at other scales, red again, none again; compiles after each."""

    def styles(*pairs: tuple[str, float]) -> list[dict[str, Any]]:
        return [{"name": name, "scale": scale} for name, scale in pairs]

    asked = {
        "none": {},
        "red": {"lora": "red", "lora_scale": 1.0},
        "blue": {"loras": styles(("blue", 1.0))},
        "red+blue": {"loras": styles(("red", 1.0), ("blue", 1.0))},
        "blue+red": {"loras": styles(("blue", 1.0), ("red", 1.0))},
        "red+blue/2": {"loras": styles(("red", 1.0), ("blue", 0.5))},
        "red-again": {"loras": '[{"name": "red"}]'},  # a JSON text, scale defaulted
        "none-again": {"loras": []},
    }
    records, compiles = {}, []
    for key, options in asked.items():
        records[key] = multi_manager.generate(PROMPT, SHAPE, STEPS, SEED, **options)
        compiles.append(multi_manager.status().compiles)
    return {"records": records, "compiles": compiles}


def test_two_styles_differ_from_either_alone_and_from_none_with_no_recompile(walk: dict[str, Any]) -> None:
    records, compiles = walk["records"], walk["compiles"]
    assert compiles[0] >= 1 and compiles == [compiles[0]] * len(compiles), "a style combination recompiled"
    assert [r.compiled for r in list(records.values())[1:]] == [False] * (len(records) - 1)
    both, red, blue, none = (pixels(records[k]) for k in ("red+blue", "red", "blue", "none"))
    for alone in (red, blue, none):
        assert np.abs(both - alone).mean() > 0.1
    assert np.abs(pixels(records["red+blue/2"]) - both).mean() > 0.1  # each style has its own scale
    np.testing.assert_array_equal(pixels(records["red-again"]), red)  # the second slot was zeroed
    np.testing.assert_array_equal(pixels(records["none-again"]), none)


def direct(manager: Any, pairs: list[tuple[str, float]]) -> np.ndarray:
    """The image with `pairs` put into the slots as given (no validation, no reordering), then the slots zeroed."""
    from neuron_app.engine.model.runner import run_call

    call = manager.validate(PROMPT, SHAPE, STEPS, SEED).call()
    with manager._device_lock:
        manager.adapters.activate_all(pairs)
        image = run_call(manager.pipe, call, guidance_scale=manager.settings.guidance_scale,
                         max_sequence_length=manager.settings.max_sequence_length)  # fmt: skip
        manager.adapters.activate("none", 1.0)
    return np.asarray(image, dtype=np.float64)


def test_the_order_of_the_list_does_not_change_the_image(walk: dict[str, Any], multi_manager: Any) -> None:
    """Slots add, so [red, blue] and [blue, red] are the same sum: blue in slot 0 and red in slot 1 gives the
    image of red + blue up to float rounding; and the request's list is put in one order, so the same bits."""
    records = walk["records"]
    both, none = pixels(records["red+blue"]), pixels(records["none"])
    swapped = direct(multi_manager, [("blue", 1.0), ("red", 1.0)])
    assert np.abs(swapped - both).mean() < 0.1 * np.abs(both - none).mean()
    np.testing.assert_array_equal(pixels(records["blue+red"]), both)


def test_the_record_names_every_style_and_scale(walk: dict[str, Any]) -> None:
    records = walk["records"]
    info = records["red+blue/2"].info()
    assert info["loras"] == [{"name": "red", "scale": 1.0}, {"name": "blue", "scale": 0.5}]
    assert (info["lora"], info["lora_scale"]) == ("red", 1.0)  # single-style readers see the first
    assert records["blue+red"].info()["loras"] == [{"name": "red", "scale": 1.0}, {"name": "blue", "scale": 1.0}]
    assert records["red"].loras == [{"name": "red", "scale": 1.0}] and records["none"].loras == []


def test_slots_are_one_per_position_and_in_the_fingerprint(multi_manager: Any, make_settings: Any) -> None:
    """Two slots here (max_loras_per_request 2 of 3 adapters); one slot keeps the one-slot fingerprint; no
    adapters inject nothing."""
    from neuron_app.engine.modes.lora import AdapterSet

    assert multi_manager.adapters.slots == 2
    assert multi_manager.adapters.fingerprint()["slots"] == 2
    one = AdapterSet(make_settings(loras=LORAS, max_loras_per_request=1))
    assert one.slots == 1 and "slots" not in one.fingerprint()
    assert AdapterSet(make_settings(loras={})).slots == 0


def test_a_slot_beyond_the_first_really_adds_its_style(multi_manager: Any) -> None:
    """Blue in slot 1 with slot 0 empty gives blue's image up to float rounding (the sum's order differs): slot 1
    is live in the graph, and far from the unstyled image."""
    none = pixels(multi_manager.generate(PROMPT, SHAPE, STEPS, SEED))
    blue = pixels(multi_manager.generate(PROMPT, SHAPE, STEPS, SEED, lora="blue"))
    in_slot_1 = direct(multi_manager, [("none", 1.0), ("blue", 1.0)])
    assert np.abs(in_slot_1 - blue).mean() < 0.1 * np.abs(blue - none).mean()


BAD = {
    "unknown": ({"loras": [{"name": "anime"}]}, "LoRA style 'anime' is not offered"),
    "duplicate": ({"loras": [{"name": "red"}, {"name": "red", "scale": 0.5}]}, "'red' is listed twice"),
    "too-many": ({"loras": [{"name": n} for n in LORAS]}, "loras lists 3 styles; this server combines at most 2"),
    "scale": ({"loras": [{"name": "red", "scale": 9}]}, "loras must be between 0 and 2, got 9"),
    "both": ({"lora": "red", "loras": [{"name": "blue"}]}, "give either lora (one style) or loras"),
    "not-json": ({"loras": "[{"}, "loras must be a JSON list"),
    "odd-key": ({"loras": [{"name": "red", "weight": 1}]}, "not 'weight'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_style_lists_are_one_clear_error_before_any_model_work(case: str, make_settings: Any) -> None:
    """One validation for every entry (engine/requests.py): refused with param `loras`, no model loaded."""
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.errors import RequestError

    options, message = BAD[case]
    manager = PipelineManager(make_settings(loras=LORAS, max_loras_per_request=2))
    with pytest.raises(RequestError) as caught:
        manager.generate(PROMPT, SHAPE, STEPS, SEED, **options)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert caught.value.param in {"loras", "lora"} and not manager.loaded


def test_the_call_followers_replay_carries_every_style(make_settings: Any) -> None:
    """Tensor-parallel followers get the pickled `PipelineCall` (scale/distributed.py) and fill their slots from
    its `loras` in `device_step`, as rank 0 does; the logs name each style, never the prompt."""
    import pickle

    from neuron_app.engine import requests
    from neuron_app.scale.distributed import describe_call

    settings = make_settings(loras=LORAS, max_loras_per_request=2)
    req = requests.validate(
        settings, [SHAPE], PROMPT, SHAPE, STEPS, SEED, loras=[{"name": "blue", "scale": 0.5}, "red"]
    )
    call = pickle.loads(pickle.dumps(req.call()))
    assert call.loras == (("red", 1.0), ("blue", 0.5))
    assert describe_call(call) == "64x64 steps=2 seed=11 lora=red x1+blue x0.5"
    assert req.portable()["loras"] == [{"name": "red", "scale": 1.0}, {"name": "blue", "scale": 0.5}]  # replicas
