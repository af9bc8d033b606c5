"""OpenAI image streaming and the queue figures, driven by the official `openai` Python SDK against the launched
quick-start model (tiny-shapes, with 256x256 as quickstart.toml serves it, so the watermark fits).

`stream=True, partial_images=2` yields two partial images and one completed event, every image marked as the
server's final images are (read back by `neuron_app verify`'s reader); edits stream as `image_edit.*`; refusals are
JSON errors before any stream; a client that goes away stops the run; the synchronous answer and a queued job say
where they stood in the queue.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from PIL import Image

from neuron_app.engine.trust.marks import DIGITAL_SOURCE_TYPE
from neuron_app.verify import configured_signer, verify_file
from neuron_app.web.openai.streaming import ImageStream, partial_steps
from neuron_app.web.queue_place import QueuePlace
from tests.support import SHAPES_OVERRIDES, openai_client, source_image, wait_for
from tests.support import png as png_bytes

PROMPT = "a red circle on a white background"


@pytest.fixture(scope="module")
def quick_app(launch_tiny: Callable[..., Any]) -> Any:
    """The app with 128x128 compiled here, so no test's own request (nor a stub wrapped around the device) meets
    its first-use compile, whichever test runs first."""
    app = launch_tiny(**SHAPES_OVERRIDES | {"resolutions": ["128x128", "256x256"], "default_steps": 4})
    app.manager.compile_shape("128x128")
    return app


def idle_lane(app: Any) -> None:
    """Until nothing is on the device lane or waiting for it: a queue place counted in a test is its own, not one
    that an earlier test's run (a stream cut short, a job) still holds."""

    def idle() -> bool:
        device = app.manager.status().stages["device"]
        return device["running"] == 0 and device["waiting"] == 0 and app.ops.extra_waiting() == 0

    wait_for(idle, 120, "the device lane to be idle")


@pytest.fixture(scope="module")
def client(quick_app: Any) -> OpenAI:
    return openai_client(quick_app)


def marked(app: Any, data: bytes, where: Path) -> tuple[Image.Image, Any]:
    """The PNG and what the project's own verifier reads in it."""
    where.write_bytes(data)
    payload = app.settings.watermark_payload.encode("ascii")
    image = Image.open(io.BytesIO(data))
    image.load()
    return image, verify_file(where, payload, configured_signer(app.settings))


def test_partial_steps_spread_over_the_run() -> None:
    assert partial_steps(4, 2) == [2, 3] and partial_steps(4, 1) == [2] and partial_steps(8, 3) == [2, 4, 6]
    assert partial_steps(2, 3) == [1, 2]  # fewer steps than partial images: one per step


def test_generate_streams_two_marked_partial_images_then_the_completed_image(
    quick_app: Any, client: OpenAI, tmp_path: Path
) -> None:
    stream = client.images.generate(
        prompt=PROMPT, size="256x256", stream=True, partial_images=2, extra_body={"seed": 5}
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds == ["image_generation.partial_image"] * 2 + ["image_generation.completed"], kinds
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    for i, event in enumerate(events):
        assert (event.size, event.output_format, event.background) == ("256x256", "png", "opaque")
        assert event.created_at > 0
        image, report = marked(quick_app, base64.b64decode(event.b64_json), tmp_path / f"{i}.png")
        assert image.size == (256, 256) and image.text["prompt"] == PROMPT and image.text["seed"] == "5"
        assert report.proof and set(report.ours) == {"c2pa", "iptc", "watermark"}, report.lines
    steps = [Image.open(io.BytesIO(base64.b64decode(e.b64_json))).text["partial_image"] for e in events[:2]]
    assert steps == ["0 (step 2 of 4)", "1 (step 3 of 4)"]
    done = events[-1]
    assert done.usage.model_extra["steps"] == 4 and done.model_extra["provenance"]["seed"] == 5
    # The same request without streaming: the same final pixels (one path to the device).
    plain = client.images.generate(prompt=PROMPT, size="256x256", extra_body={"seed": 5})
    final = Image.open(io.BytesIO(base64.b64decode(done.b64_json))).convert("RGB")
    again = Image.open(io.BytesIO(base64.b64decode(plain.data[0].b64_json))).convert("RGB")
    assert final.tobytes() == again.tobytes()


def test_no_partial_images_is_one_completed_event(client: OpenAI) -> None:
    events = list(client.images.generate(prompt=PROMPT, size="128x128", stream=True, extra_body={"seed": 1}))
    assert [e.type for e in events] == ["image_generation.completed"]
    assert events[0].size == "128x128"


def test_edit_streams_as_image_edit_events(quick_app: Any, client: OpenAI, tmp_path: Path) -> None:
    reference = png_bytes(source_image(128))
    stream = client.images.edit(
        image=("ref.png", reference, "image/png"),
        prompt="a blue square on a black background",
        size="128x128",
        stream=True,
        partial_images=1,
    )
    events = list(stream)
    assert [e.type for e in events] == ["image_edit.partial_image", "image_edit.completed"]
    _, report = marked(quick_app, base64.b64decode(events[-1].b64_json), tmp_path / "edit.png")
    assert "iptc" in report.ours and report.proof  # 128x128: under the watermark's 256 px, the other marks
    image = Image.open(io.BytesIO(base64.b64decode(events[0].b64_json)))
    assert "partial_image" in image.text and image.info.get("XML:com.adobe.xmp", "").count(DIGITAL_SOURCE_TYPE)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"partial_images": 4}, "partial_images"),
        ({"partial_images": -1}, "partial_images"),
        ({"partial_images": True}, "partial_images"),
        ({"partial_images": "2"}, "partial_images"),
        ({"stream": "yes"}, "stream"),
        ({"stream": True, "n": 2}, "n"),
        ({"stream": True, "response_format": "url"}, "response_format"),
    ],
)
def test_bad_stream_requests_are_json_400s_before_any_stream(
    quick_app: Any, client: OpenAI, extra: dict[str, Any], param: str
) -> None:
    idle_lane(quick_app)  # an earlier test's run (a stream cut short) is served before the count is taken
    before = quick_app.manager.status().stages["device"]["served"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.generate(prompt=PROMPT, size="128x128", extra_body=extra)
    assert caught.value.status_code == 400 and caught.value.param == param
    assert caught.value.response.headers["content-type"] == "application/json"
    assert quick_app.manager.status().stages["device"]["served"] == before  # nothing ran


def test_a_stream_is_not_a_job(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="do not go together") as caught:
        client.images.generate(
            prompt=PROMPT, size="128x128", extra_body={"stream": True}, extra_headers={"Prefer": "respond-async"}
        )
    assert caught.value.param == "stream"


def test_partial_images_without_stream_is_refused(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="partial_images needs stream=true"):
        client.images.generate(prompt=PROMPT, size="128x128", partial_images=2)


def test_a_failure_after_the_stream_began_is_an_error_event(quick_app: Any, client: OpenAI) -> None:
    """The SDK raises the error event's error (here a failure in the run: the model's pipeline made to fail)."""
    manager = quick_app.manager
    original = manager._execute

    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("the device went away")

    manager._execute = broken
    try:
        stream = client.images.generate(prompt=PROMPT, size="128x128", stream=True, partial_images=1)
        with pytest.raises(openai.APIError, match="generation failed"):
            list(stream)
    finally:
        manager._execute = original


def test_a_partial_image_that_cannot_be_marked_ends_the_stream_with_an_error(
    client: OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unmarkable(*_args: Any) -> bytes:
        raise OSError("the signer is unreachable")

    monkeypatch.setattr(ImageStream, "partial", unmarkable)
    stream = client.images.generate(prompt=PROMPT, size="128x128", stream=True, partial_images=1)
    with pytest.raises(openai.APIError, match="the signer is unreachable"):
        list(stream)


def test_a_client_that_goes_away_stops_the_run(quick_app: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client closes the stream during the first step: the run ends there (the second step never comes), and
    its queue place is given back."""
    manager = quick_app.manager
    streams: list[ImageStream] = []
    respond = ImageStream.response

    def recorded(self: ImageStream, headers: dict[str, str]) -> Any:
        streams.append(self)
        return respond(self, headers)

    monkeypatch.setattr(ImageStream, "response", recorded)
    entered, closed = threading.Event(), threading.Event()
    seen: list[int] = []
    original = manager._execute

    def held(call: Any, on_step: Any = None) -> Any:  # the first step waits until the server has seen the client go
        if on_step is None:  # a compile's warm-up call (none here: 128x128 is compiled), not the request
            return original(call)

        def step(number: int, total: int, preview: Any = None) -> None:
            seen.append(number)
            entered.set()
            closed.wait(60)
            on_step(number, total, preview)

        return original(call, step)

    idle_lane(quick_app)
    monkeypatch.setattr(manager, "_execute", held)
    served = manager.status().stages["device"]["served"]
    try:
        body = {"prompt": PROMPT, "size": "128x128", "stream": True, "partial_images": 2}
        with httpx.stream("POST", quick_app.url + "v1/images/generations", json=body, timeout=60) as reply:
            assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
            assert reply.headers["x-queue-position"] == "0"
            assert entered.wait(60)
        wait_for(lambda: streams[-1].stop.is_set(), 60, "the server to see the client go")
    finally:
        closed.set()
    wait_for(lambda: manager.status().stages["device"]["served"] > served, 60, "the lane let go")
    wait_for(lambda: quick_app.ops.extra_waiting() == 0, 60, "the queue place given back")
    assert seen == [1], seen  # cancelled at its first step: the second was never reached


def test_answers_and_jobs_say_their_queue_place(
    quick_app: Any, client: OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Idle: position 0 and an ETA (the device has timed a request). Behind a request held on the device, a
    synchronous request stands at 1 and a job submitted next at 2, in its 202 and in its view."""
    idle_lane(quick_app)
    client.images.generate(prompt=PROMPT, size="128x128", extra_body={"seed": 2})  # the device timed once
    reply = client.images.with_raw_response.generate(prompt=PROMPT, size="128x128", extra_body={"seed": 2})
    assert reply.headers["x-queue-position"] == "0" and float(reply.headers["x-queue-eta-seconds"]) > 0

    manager = quick_app.manager
    entered, go = threading.Event(), threading.Event()
    original, calls = manager._execute, []

    def held(call: Any, on_step: Any = None) -> Any:  # only the first run waits on the device, at its first step
        if on_step is None:  # a compile's warm-up call (none here: 128x128 is compiled), not a request
            return original(call)
        calls.append(call)
        if len(calls) > 1:
            return original(call, on_step)

        def step(number: int, total: int, preview: Any = None) -> None:
            entered.set()
            go.wait(60)
            on_step(number, total, preview)

        return original(call, step)

    monkeypatch.setattr(manager, "_execute", held)
    body = {"prompt": PROMPT, "size": "128x128"}
    url = quick_app.url + "v1/images/generations"
    answers: dict[str, httpx.Response] = {}

    def post(name: str) -> None:
        answers[name] = httpx.post(url, json=body, timeout=120)

    first = threading.Thread(target=post, args=("first",))
    first.start()
    assert entered.wait(60)
    second = threading.Thread(target=post, args=("second",))
    second.start()
    wait_for(lambda: quick_app.ops.extra_waiting() == 2, 60, "the second request admitted")
    try:
        job = httpx.post(url, json=body, headers={"Prefer": "respond-async"}, timeout=60)
        assert job.status_code == 202 and job.headers["x-queue-position"] == "2" and job.json()["queue_position"] == 2
        view = httpx.get(quick_app.url + f"v1/images/jobs/{job.json()['id']}", timeout=60).json()
        assert view["queue_position"] == 2 and view["queue_eta_s"] > 0, view
    finally:
        go.set()
    first.join(120)
    second.join(120)
    assert answers["first"].headers["x-queue-position"] == "0"
    assert answers["second"].headers["x-queue-position"] == "1"
    # One request more ahead of it: at least the step the held request has left more. The header has one decimal,
    # and a tiny-shapes 128x128 step (0.025 s of a 0.1 s run) can round away, so the exact sum is checked on a
    # status of known figures (test_hardening_lows.py's ETA tests, and the count-down test below).
    eta = float(answers["second"].headers["x-queue-eta-seconds"])
    assert eta >= float(answers["first"].headers["x-queue-eta-seconds"]) > 0
    done = wait_for(
        lambda: (
            (v := httpx.get(quick_app.url + f"v1/images/jobs/{job.json()['id']}", timeout=60).json())["status"]
            in ("succeeded", "failed")
            and v
        ),
        120,
        "the job to end",
    )
    assert done["status"] == "succeeded" and "queue_position" not in done


def test_a_queue_place_counts_down_as_requests_ahead_let_the_lane_go(quick_app: Any) -> None:
    """Three ahead when admitted; two served since: one ahead, and the ETA is (1 round + its own image) x the median.
    The status is the app's with this test's own lane figures and no shape table: nothing an earlier test ran (its
    runs per shape, a request still on the device, a shape not compiled yet) enters the sums."""
    status = dataclasses.replace(quick_app.manager.status(), shapes={}, stages={})

    def at(served: int, median_s: float | None) -> Any:
        return dataclasses.replace(status, stages={"device": {"served": served, "median_s": median_s}})

    place = dataclasses.replace(QueuePlace.taken(at(10, 2.0), 3, 1), resolution="128x128")
    assert place.position(at(10, 2.0)) == 3 and place.eta_s(at(10, 2.0)) == 8.0
    assert place.figures(at(12, 2.0)) == {"queue_position": 1, "queue_eta_s": 4.0}
    assert place.position(at(20, 2.0)) == 0  # never below 0
    assert place.headers(at(12, None)) == {"X-Queue-Position": "1"}  # no timed request yet: no ETA
    two_lanes = QueuePlace.taken(at(10, 2.0), 3, 2)
    assert two_lanes.eta_s(at(10, 2.0)) == 6.0  # the three ahead take two rounds on two lanes


def test_no_partial_image_leaves_while_the_safety_checker_is_on(launch_tiny: Callable[..., Any]) -> None:
    """A preview is a picture of an image nobody has checked yet: with the checker on, the stream has only the
    completed (checked) image."""
    checked = openai_client(launch_tiny(safety_checker="on", safety_model="tiny"))
    events = list(checked.images.generate(prompt=PROMPT, size="64x64", stream=True, partial_images=2))
    assert [e.type for e in events] == ["image_generation.completed"]
    assert events[0].model_extra["provenance"]["safety"] != "off"
