"""The OpenAI-compatible Images API, driven by the official `openai` Python SDK against the launched tiny app.

Success as `b64_json` and `url`, n images with consecutive seeds and no extra compile, every error with
its status code and message, auth on and off, the shared queue (429) and shutdown (503). Raw HTTP only
where the SDK cannot send the faulty request (a body that is not JSON, a wrong content type, too large).
"""

from __future__ import annotations

import base64
import io
import threading
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from PIL import Image

from neuron_app.engine.requests import MAX_SEED, check_images, check_seed_run, resolve_size
from neuron_app.errors import RequestError
from tests.support import openai_client, wait_for

KEY = f"sk-test-{uuid.uuid4().hex}"
PROMPT = "a lighthouse at dawn"
OFFERED = "64x64, 128x64, 64x128, 128x128"


def png(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


@pytest.fixture(scope="module")
def api_app(launch_tiny: Callable[..., Any]) -> Any:
    return launch_tiny()


@pytest.fixture(scope="module")
def client(api_app: Any) -> OpenAI:
    return openai_client(api_app)


def ok_requests(app: Any) -> float:
    text = httpx.get(app.url + "metrics", timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith('neuron_app_requests_total{result="ok"}'))
    return float(line.split()[-1])


# --- what the helpers accept -----------------------------------------------------------------------


def test_n_seeds_and_size_rules() -> None:
    """n is 1..max_images; every consecutive seed must be valid; absent or "auto" size is the default shape."""
    assert check_images(3, 4) == 3 and check_images(4.0, 4) == 4
    for bad in (0, 5, 2.5, "3", None):
        with pytest.raises(RequestError, match=r"^n must be"):
            check_images(bad, 4)
    assert check_seed_run(MAX_SEED - 2, 3) == MAX_SEED - 2
    with pytest.raises(RequestError, match=f"seed must be between 0 and {MAX_SEED - 2}"):
        check_seed_run(MAX_SEED - 1, 3)
    assert resolve_size(None, "64x64", ["64x64", "128x64"]) == "64x64"
    assert resolve_size("auto", "1024x1024", ["128x64"]) == "128x64"  # default not offered: the first that is
    assert resolve_size("128x64", "64x64", ["64x64"]) == "128x64"  # validated later, with the offered list


# --- success ---------------------------------------------------------------------------------------


def test_b64_json_is_the_same_image_as_the_gradio_api(api_app: Any, client: OpenAI) -> None:
    """b64_json (the default) is a PNG of the asked size with its provenance; the same inputs through Gradio's
    named API give the same pixels: one path to the device."""
    result = client.images.generate(prompt=PROMPT, size="64x64", extra_body={"seed": 7, "num_inference_steps": 2})
    assert len(result.data) == 1 and result.data[0].url is None
    image = png(base64.b64decode(result.data[0].b64_json))
    assert image.size == (64, 64) and image.text["prompt"] == PROMPT and image.text["seed"] == "7"
    provenance = result.data[0].model_extra["provenance"]
    assert (provenance["seed"], provenance["resolution"], provenance["steps"]) == (7, "64x64", 2)
    assert provenance["cache"] in ("miss", "memory", "disk")

    from gradio_client import Client

    from tests.support import PATIENT_HTTP

    path, info = Client(api_app.url, verbose=False, httpx_kwargs=PATIENT_HTTP).predict(
        PROMPT, "64x64", 2, 7, api_name="/generate"
    )
    assert info["cache"] == "memory"
    assert Image.open(path).convert("RGB").tobytes() == image.convert("RGB").tobytes()


def test_url_is_served_for_a_while_under_an_unguessable_name(api_app: Any, client: OpenAI) -> None:
    result = client.images.generate(prompt=PROMPT, size="auto", response_format="url", extra_body={"seed": 1})
    url = result.data[0].url
    assert result.data[0].b64_json is None and url.startswith(api_app.url + "v1/images/files/")
    name = url.rsplit("/", 1)[1]
    assert len(name) == len("x" * 43 + ".png")
    reply = httpx.get(url, timeout=10)
    assert reply.status_code == 200 and reply.headers["content-type"] == "image/png"
    assert png(reply.content).size == (64, 64)  # "auto" is the default shape
    path = api_app.settings.cache_dir / "api-images" / name
    assert path.is_file()
    # Not through Gradio's file route: it serves outputs_dir to anyone, with no key and no expiry.
    assert httpx.get(f"{api_app.url}gradio_api/file={path}", timeout=10).status_code in (403, 404)
    for missing in ("A" * 43 + ".png", "short.png", name[:-4] + ".PNG"):
        reply = httpx.get(api_app.url + "v1/images/files/" + missing, timeout=10)
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "not_found", missing
    # A path that climbs out matches no file route at all.
    assert httpx.get(api_app.url + "v1/images/files/..%2F..%2Fmanifest.json", timeout=10).status_code == 404


def test_n_images_have_consecutive_seeds_and_cost_no_compile(api_app: Any, client: OpenAI) -> None:
    """n=3 on a ready shape: three different images, seeds s, s+1, s+2, zero graphs compiled, three hits and
    three requests in /metrics (they went through `generate`)."""
    manager = api_app.manager
    client.images.generate(prompt=PROMPT, size="64x64", extra_body={"seed": 0, "num_inference_steps": 1})
    graphs, hits, ok = manager.counter.graphs, manager.status().shapes["64x64"].hits, ok_requests(api_app)

    result = client.images.generate(prompt=PROMPT, size="64x64", n=3, extra_body={"seed": 40})
    assert [d.model_extra["provenance"]["seed"] for d in result.data] == [40, 41, 42]
    images = [png(base64.b64decode(d.b64_json)) for d in result.data]
    assert all(image.size == (64, 64) for image in images)
    assert len({image.convert("RGB").tobytes() for image in images}) == 3
    assert manager.counter.graphs == graphs
    assert manager.status().shapes["64x64"].hits == hits + 3
    assert ok_requests(api_app) == ok + 3


def test_models_lists_the_served_model(client: OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny"]


# --- errors ------------------------------------------------------------------------------------------

BAD_REQUESTS = {
    "size-not-offered": (
        {"size": "1024x1024"},
        "size",
        f"resolution 1024x1024 is not offered; choose one of {OFFERED}",
    ),
    "size-malformed": ({"size": "big"}, "size", "is not of the form WIDTHxHEIGHT"),
    # every size refusal names `size` and lists what is offered, whatever the engine refuses the shape for
    "size-1000x1000": ({"size": "1000x1000"}, "size", f"must be a positive multiple of 16; choose one of {OFFERED}"),
    "size-300x300": ({"size": "300x300"}, "size", f"; choose one of {OFFERED}"),
    "size-abc": ({"size": "abc"}, "size", f"e.g. '1024x1024'; choose one of {OFFERED}"),
    "n-zero": ({"n": 0}, "n", "n must be between 1 and 4, got 0"),
    "n-above-max": ({"n": 5}, "n", "n must be between 1 and 4, got 5"),
    "prompt-empty": ({"prompt": "   "}, "prompt", "prompt is empty"),
    "steps-too-many": ({"extra_body": {"num_inference_steps": 99}}, "num_inference_steps", "steps must be between"),
    "seed-negative": ({"extra_body": {"seed": -1}}, "seed", "seed must be between"),
    "response-format": ({"response_format": "jpeg"}, "response_format", "response_format must be one of"),
    "model-other": ({"model": "dall-e-3"}, "model", "model 'dall-e-3' is not served here"),
    "stream-partial-images": (  # streaming itself: tests/web/test_openai_stream.py
        {"extra_body": {"stream": True, "partial_images": 4}},
        "partial_images",
        "partial_images must be a whole number from 0 to 3",
    ),
    "lora-unknown": ({"extra_body": {"lora": "anime"}}, "lora", "LoRA style 'anime' is not offered"),
    "lora-scale": ({"extra_body": {"lora_scale": 99}}, "lora_scale", "lora_scale must be between 0 and"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS), ids=list(BAD_REQUESTS))
def test_bad_requests_are_400_with_the_reason_and_compile_nothing(api_app: Any, client: OpenAI, case: str) -> None:
    overrides, param, message = BAD_REQUESTS[case]
    compiles = api_app.manager.status().compiles
    kwargs = {"prompt": PROMPT, "size": "128x128"} | overrides  # 128x128 is never compiled in this module
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.generate(**kwargs)
    error = caught.value.body
    assert caught.value.status_code == 400 and message in error["message"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert error["code"], error  # every 400 has a machine-readable code (response_format had none)
    assert api_app.manager.status().compiles == compiles
    assert api_app.manager.status().shapes["128x128"].state == "not_compiled"


def test_raw_http_errors_are_openai_shaped(api_app: Any) -> None:
    """What the SDK never sends: a body that is not JSON or not an object, another content type, a body over
    the limit (413), declared or not."""
    url = api_app.url + "v1/images/generations"
    cases = [
        ({"content": b"{not json", "headers": {"content-type": "application/json"}}, 400, "not valid JSON"),
        ({"json": ["a", "list"]}, 400, "must be a JSON object"),
        ({"data": {"prompt": PROMPT}}, 400, "Content-Type must be application/json"),
        ({"json": {"prompt": "x" * (2 << 20)}}, 413, "larger than 1048576 bytes"),
        ({"content": iter([b'{"prompt": "', b"x" * (2 << 20), b'"}']),
          "headers": {"content-type": "application/json"}}, 413, "larger than"),
    ]  # fmt: skip
    compiles = api_app.manager.status().compiles
    for kwargs, status, message in cases:
        reply = httpx.post(url, timeout=30, **kwargs)
        error = reply.json()["error"]
        assert reply.status_code == status and message in error["message"], (reply.status_code, error)
        assert set(error) == {"message", "type", "param", "code"}
    assert api_app.manager.status().compiles == compiles


def test_edits_run_the_editing_path(client: OpenAI, api_app: Any) -> None:
    """`images.edit` with reference images: size auto follows the first reference; a bad image is a 400 naming
    it, and compiles nothing."""
    buf = io.BytesIO()
    Image.new("RGB", (100, 200), (20, 120, 220)).save(buf, "PNG")
    result = client.images.edit(
        image=[("tall.png", buf.getvalue(), "image/png")], prompt=PROMPT, n=2, extra_body={"seed": 3}
    )
    provenance = result.data[0].model_extra["provenance"]
    assert provenance["resolution"] == "64x128" and provenance["references"][0]["bucket"] == "64x128"
    assert [d.model_extra["provenance"]["seed"] for d in result.data] == [3, 4]  # n edits, consecutive seeds
    assert Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))).size == (64, 128)
    compiles = api_app.manager.status().compiles
    with pytest.raises(openai.BadRequestError, match="reference image 1 is not a readable image") as caught:
        client.images.edit(image=("ref.png", b"\x89PNG not really", "image/png"), prompt=PROMPT)
    assert caught.value.body["param"] == "image"
    assert api_app.manager.status().compiles == compiles


# --- auth, queue, shutdown ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_app(launch_tiny: Callable[..., Any]) -> Any:
    """An API key, and a queue holding one waiting request (with one running)."""
    return launch_tiny(api_key=KEY, queue_max_size=1, max_references=0)


def test_edits_answer_a_clear_501_when_editing_is_off(keyed_app: Any) -> None:
    """max_references = 0 switches editing off: `images.edit` gets a clear 501, never a traceback."""
    with pytest.raises(openai.APIStatusError) as caught:
        openai_client(keyed_app, KEY).images.edit(image=("ref.png", b"\x89PNG", "image/png"), prompt=PROMPT)
    assert caught.value.status_code == 501
    assert caught.value.body["message"] == "image editing is not available on this server"


def test_api_key_is_required_when_set(keyed_app: Any) -> None:
    """With an API key: no key or a wrong one is 401 (nothing runs); the right one generates."""
    app = keyed_app
    before = (app.manager.status().compiles, app.manager.loaded, app.manager.status().stages["device"]["served"])
    for wrong in ("unused", KEY + "x", KEY[:-1]):
        with pytest.raises(openai.AuthenticationError) as caught:
            openai_client(app, wrong).images.generate(prompt=PROMPT, size="64x64")
        assert caught.value.body["code"] == "invalid_api_key"
    reply = httpx.post(app.url + "v1/images/generations", json={"prompt": PROMPT}, timeout=10)
    assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
    now = app.manager.status()  # nothing ran: counted from this test's start (the module's app is shared)
    assert (now.compiles, app.manager.loaded, now.stages["device"]["served"]) == before
    result = openai_client(app, KEY).images.generate(prompt=PROMPT, size="64x64", extra_body={"num_inference_steps": 1})
    assert png(base64.b64decode(result.data[0].b64_json)).size == (64, 64)


def test_page_auth_without_api_key_refuses_the_api_and_mcp(launch_tiny: Callable[..., Any]) -> None:
    """A login on the page and no API key: the API never serves the public; MCP (no login of its own) is off."""
    app = launch_tiny(auth_username="alice", auth_password=f"pw-{uuid.uuid4().hex}")
    with pytest.raises(openai.AuthenticationError) as caught:
        openai_client(app, "anything").images.generate(prompt=PROMPT, size="64x64")
    assert caught.value.body["code"] == "api_key_required" and "NEURON_APP_API_KEY" in caught.value.body["message"]
    assert httpx.get(app.url + "gradio_api/mcp/", timeout=10).status_code in (401, 404)
    assert not app.manager.loaded


def test_full_queue_is_429_and_shutdown_is_503(launch_tiny: Callable[..., Any]) -> None:
    """API requests wait on the same device as the page: with the device held and the queue full (one running,
    one waiting), the next is 429 at once; the held ones finish. While draining, 503. On an app of its own, as the
    keyed app's settings: the drain shuts it down, which any test after it on a shared app would meet."""
    app = launch_tiny(api_key=KEY, queue_max_size=1, max_references=0)
    client = openai_client(app, KEY)
    client.images.generate(prompt=PROMPT, size="64x64", extra_body={"num_inference_steps": 1})  # load + compile
    results: list[Any] = []

    def send() -> None:
        results.append(client.images.generate(prompt=PROMPT, size="64x64", extra_body={"num_inference_steps": 1}))

    with app.manager._device_lock:  # the device is busy (as with a long compile)
        threads = [threading.Thread(target=send) for _ in range(2)]
        for thread in threads:
            thread.start()
        wait_for(lambda: app.manager.in_flight == 2, 300, "both requests in flight")
        metrics = httpx.get(app.url + "metrics", timeout=10).text
        assert "neuron_app_queue_length 2.0" in metrics.splitlines()  # API requests count in the queue gauge
        with pytest.raises(openai.RateLimitError) as caught:
            client.images.generate(prompt=PROMPT, size="64x64")
        assert caught.value.body["code"] == "queue_full" and caught.value.response.headers["retry-after"]
    for thread in threads:
        thread.join(timeout=120)
    assert len(results) == 2

    assert app.manager.drain(5.0)
    with pytest.raises(openai.InternalServerError) as caught:
        client.images.generate(prompt=PROMPT, size="64x64")
    assert caught.value.status_code == 503 and "shutting down" in caught.value.body["message"]
