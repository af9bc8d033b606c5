"""The public API, driven through gradio_client against the launched tiny app."""

from __future__ import annotations

from typing import Any

import pytest
from gradio_client.exceptions import AppError
from PIL import Image


def test_generate_compiles_then_serves_from_memory_and_status_counts_hits(launch_tiny: Any) -> None:
    """On an app of its own: its first image is the app's first compile, whichever test ran before it."""
    from gradio_client import Client

    from tests.support import PATIENT_HTTP

    client = Client(launch_tiny().url, verbose=False, httpx_kwargs=PATIENT_HTTP)
    path, info = client.predict("a lighthouse", "64x64", 4, 7, api_name="/generate")
    assert info["cache"] == "miss" and info["compiled"] is True and info["compile_s"] > 0
    assert {"resolution", "steps", "seed", "cache", "compiled", "compile_s", "inference_s"} <= info.keys()
    with Image.open(path) as image:
        assert image.size == (64, 64)
        assert image.text["prompt"] == "a lighthouse" and image.text["seed"] == "7"

    _path, again = client.predict("a lighthouse", "64x64", 4, 7, api_name="/generate")
    assert again["cache"] == "memory" and again["compiled"] is False

    status = client.predict(api_name="/status")
    assert status["compiles"] == 1
    shape = status["shapes"]["64x64"]
    assert shape["state"] == "ready" and shape["hits"] == 2 and shape["compile_s"] > 0
    assert status["shapes"]["128x128"]["state"] == "not_compiled"


def test_changing_steps_does_not_compile(client: Any) -> None:
    client.predict("steps", "64x64", 4, 1, api_name="/generate")
    before = client.predict(api_name="/status")["compiles"]
    _path, info = client.predict("steps", "64x64", 2, 1, api_name="/generate")
    assert info["steps"] == 2 and info["cache"] == "memory"
    assert client.predict(api_name="/status")["compiles"] == before


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("a cat", "4096x4096", 4, 1), "not offered"),
        (("a cat", "1024x1024", 4, 1), "not offered"),
        (("a cat", "64x64", 0, 1), "steps must be between 1 and 8"),
        (("a cat", "64x64", 100, 1), "steps must be between 1 and 8"),
    ],
)
def test_requests_the_dropdown_would_not_offer_are_refused_clearly(client: Any, args: tuple, fragment: str) -> None:
    before = client.predict(api_name="/status")["compiles"]
    with pytest.raises(AppError, match=fragment):
        client.predict(*args, api_name="/generate")
    status = client.predict(api_name="/status")  # the server keeps answering
    assert status["compiles"] == before


def test_api_surface_is_the_public_contract(client: Any) -> None:
    endpoints = client.view_api(return_format="dict", print_info=False)["named_endpoints"]
    assert set(endpoints) == {"/generate", "/edit", "/inpaint", "/status", "/cancel_job"}
    assert [p["parameter_name"] for p in endpoints["/cancel_job"]["parameters"]] == ["job_id"]  # MCP's cancel_job
    names = [p["parameter_name"] for p in endpoints["/generate"]["parameters"]]
    assert names == ["prompt", "resolution", "steps", "seed", "lora", "lora_scale", "loras"]
    defaults = {p["parameter_name"]: p.get("parameter_default") for p in endpoints["/generate"]["parameters"][4:]}
    assert defaults == {"lora": "none", "lora_scale": 1.0, "loras": None}  # optional: 4-argument callers keep working
    names = [p["parameter_name"] for p in endpoints["/edit"]["parameters"]]
    assert names == ["prompt", "images", "resolution", "steps", "seed", "lora", "lora_scale", "loras"]
    names = [p["parameter_name"] for p in endpoints["/inpaint"]["parameters"]]
    assert names == [
        "prompt",
        "image",
        "mask",
        "resolution",
        "steps",
        "seed",
        "lora",
        "lora_scale",
        "strength",
        "loras",
    ]
    assert endpoints["/status"]["parameters"] == []
    # named outputs (not value_39), whole numbers typed int
    assert [r["label"] for r in endpoints["/generate"]["returns"]] == ["image", "record"]
    assert [r["label"] for r in endpoints["/status"]["returns"]] == ["status"]
    for name in ("/generate", "/edit"):
        types = {p["parameter_name"]: p["python_type"]["type"] for p in endpoints[name]["parameters"]}
        assert types["steps"] == types["seed"] == "int", types


def call_raw(url: str, endpoint: str, data: list[Any]) -> tuple[str, str]:
    """Gradio's HTTP API as @gradio/client speaks it: a positional `data` list padded with nulls, no defaults
    filled in by the client (gradio_client fills them). Returns (the SSE event, its data)."""
    import httpx

    event_id = httpx.post(f"{url}gradio_api/call/{endpoint}", json={"data": data}, timeout=30).json()["event_id"]
    text = httpx.get(f"{url}gradio_api/call/{endpoint}/{event_id}", timeout=300).text
    blocks = [b for b in text.split("\n\n") if b.startswith("event: ") and "heartbeat" not in b]
    event, _, payload = blocks[-1].partition("\ndata: ")
    return event.removeprefix("event: "), payload


def test_optional_inputs_sent_as_null_take_their_defaults(launched_app: Any) -> None:
    """@gradio/client's positional predict("/generate", ["a fox", "64x64", 4, 7]) sends null for lora,
    lora_scale and loras: the defaults, not "lora_scale must be a number, got NoneType"; a required one says it is
    missing."""
    import json

    event, payload = call_raw(launched_app.url, "generate", ["a fox", "64x64", 1, 7, None, None, None])
    assert event == "complete", payload
    record = json.loads(payload)[1]
    assert (record["lora"], record["lora_scale"]) == ("none", 1.0)
    event, payload = call_raw(launched_app.url, "generate", ["a fox", "64x64", None, 7, None, None, None])
    assert event == "error" and "steps must be a whole number between 1 and 8; it is missing" in payload, payload


def test_view_api_labels_are_the_parameter_names(client: Any) -> None:
    """Not Gradio's `parameter_36`: a client that shows labels (view_api(), @gradio/client) shows the names."""
    endpoints = client.view_api(return_format="dict", print_info=False)["named_endpoints"]
    for name in ("/generate", "/edit", "/inpaint"):
        for parameter in endpoints[name]["parameters"]:
            assert parameter["label"] == parameter["parameter_name"], (name, parameter)
