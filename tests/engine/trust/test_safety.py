"""The safety checker (engine/trust/safety.py): auto/on/off, the real classifier path on its offline stand-in, and
every entry's answer when an image passes (`"safety": "passed"`) or is flagged (refused, no file left).

The stand-in is a one-layer ViT saved with `save_pretrained` and loaded through transformers'
`from_pretrained`, with weights set so that it flags solid magenta and passes noise: no explicit material.
The tiny FLUX.2-klein draws noise, so the end-to-end refusal uses a real setting instead: a
`safety_threshold` below the stand-in's score for noise (about 1e-16) flags every image it makes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from neuron_app.engine.trust.safety import TINY_FLAGGED_COLOUR, SafetyChecker
from neuron_app.errors import ContentRefused
from tests.support import PATIENT_HTTP

SAFE = {"safety_checker": "on", "safety_model": "tiny"}


def metric(app: Any, name: str) -> float:
    text = httpx.get(app.url + "metrics", timeout=10).text
    return float(next(line for line in text.splitlines() if line.startswith(name)).split()[-1])


def pngs(*folders: Path) -> list[Path]:
    return [p for folder in folders if folder.exists() for p in folder.rglob("*.png")]


def test_auto_is_on_when_others_can_reach_the_app(make_settings: Callable[..., Any]) -> None:
    for name in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert not make_settings(server_name=name).safety_on, name
    for name in ("0.0.0.0", "10.1.2.3", "::", "demo.example.com"):
        assert make_settings(server_name=name).safety_on, name
    assert make_settings(share=True).safety_on
    assert not make_settings(server_name="0.0.0.0", safety_checker="off").safety_on
    assert make_settings(safety_checker="on").safety_on


def test_the_stand_in_classifier_flags_magenta_and_passes_noise(make_settings: Callable[..., Any]) -> None:
    checker = SafetyChecker(make_settings(**SAFE))
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (256, 256, 3), dtype=np.uint8))
    assert checker.check(noise) == "passed" and checker.score(noise) < 1e-6
    assert checker.check(Image.new("RGB", (64, 64), (128, 128, 128))) == "passed"
    with pytest.raises(ContentRefused, match="flagged by this server's safety checker") as caught:
        checker.check(Image.new("RGB", (256, 256), TINY_FLAGGED_COLOUR))
    assert caught.value.code == "content_policy_violation" and caught.value.param is None
    assert checker.snapshot() == {
        "checker": "on",
        "model": "tiny",
        "passed": 2,
        "flagged": 1,
        "error": None,
        "device": "host",
        "graphs": 0,
    }
    folder = make_settings().cache_dir / "models"
    assert any((p / "config.json").is_file() and (p / "preprocessor_config.json").is_file() for p in folder.iterdir())
    off = SafetyChecker(make_settings(safety_checker="off", safety_model="tiny"))
    assert off.check(Image.new("RGB", (64, 64), TINY_FLAGGED_COLOUR)) == "off"  # off: not even loaded


def test_images_that_arrive_while_a_pass_runs_go_together_on_the_thread_budget(
    make_settings: Callable[..., Any],
) -> None:
    """The classifier's batches: the first image runs at once, the three that arrive meanwhile share the next pass;
    each gets its own verdict, and the pass runs on `safety_threads` threads, the caller's count given back."""
    import threading

    import torch

    from tests.support import wait_for

    checker = SafetyChecker(make_settings(**SAFE, safety_threads=1))
    magenta = Image.new("RGB", (64, 64), TINY_FLAGGED_COLOUR)
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    seen: list[int] = []
    go = threading.Event()
    real = checker.score_batch

    def first_waits(images: list[Any]) -> list[float]:  # the real pass, the first one held until the others queue
        if not checker._batcher.batches[:-1]:
            go.wait(60)
        return real(images)

    checker._batcher._run = first_waits
    model = checker.load()[1]  # the threads the classifier's forward pass really runs on
    model.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    scores: dict[int, float] = {}
    images = [noise, magenta, noise, magenta]
    threads = [threading.Thread(target=lambda i=i: scores.__setitem__(i, checker.score(images[i]))) for i in range(4)]
    threads[0].start()
    wait_for(lambda: checker._batcher.batches == [1], 60, "the first pass")
    for thread in threads[1:]:
        thread.start()
    wait_for(lambda: len(checker._batcher._queue) == 3, 60, "three images queued behind it")
    go.set()
    for thread in threads:
        thread.join(60)
    assert checker._batcher.batches == [1, 3]
    assert scores[0] < 1e-6 and scores[2] < 1e-6 and scores[1] > 0.5 and scores[3] > 0.5
    before = torch.get_num_threads()
    assert checker.score_batch([noise]) and torch.get_num_threads() == before  # the caller's count is back
    assert seen == [1, 1, 1]  # torch runs on 2 threads here otherwise (two cores)


@pytest.fixture(scope="module")
def safe_app(launch_tiny: Callable[..., Any]) -> Any:
    return launch_tiny(**SAFE)


def test_every_entry_says_passed_when_the_checker_is_on(safe_app: Any) -> None:
    from gradio_client import Client
    from openai import OpenAI

    _path, info = Client(safe_app.url, verbose=False, httpx_kwargs=PATIENT_HTTP).predict(
        "a calm lake", "64x64", 2, 1, api_name="/generate"
    )
    assert info["safety"] == "passed"
    client = OpenAI(base_url=safe_app.url + "v1", api_key="unused", max_retries=0, timeout=300)
    result = client.images.generate(prompt="a calm lake", size="64x64", n=2, extra_body={"num_inference_steps": 2})
    assert [d.model_extra["provenance"]["safety"] for d in result.data] == ["passed", "passed"]
    status = safe_app.manager.status().safety
    assert status == {
        "checker": "on",
        "model": "tiny",
        "passed": 3,
        "flagged": 0,
        "error": None,
        "device": "host",
        "graphs": 0,
    }
    assert metric(safe_app, 'neuron_app_safety_images_total{result="passed"}') == 3


def test_a_flagged_image_is_refused_everywhere_and_leaves_no_file(launch_tiny: Callable[..., Any]) -> None:
    from gradio_client import Client
    from openai import BadRequestError, OpenAI

    app = launch_tiny(**SAFE, safety_threshold=1e-30)
    settings = app.settings
    temp = Path(os.environ["GRADIO_TEMP_DIR"])
    before = set(pngs(temp))
    with pytest.raises(Exception, match="flagged by this server's safety checker"):
        Client(app.url, verbose=False, httpx_kwargs=PATIENT_HTTP).predict(
            "a calm lake", "64x64", 2, 1, api_name="/generate"
        )
    client = OpenAI(base_url=app.url + "v1", api_key="unused", max_retries=0, timeout=300)
    for response_format in ("b64_json", "url"):
        with pytest.raises(BadRequestError) as caught:
            steps = {"num_inference_steps": 2}
            client.images.generate(prompt="a lake", size="64x64", response_format=response_format, extra_body=steps)
        error = caught.value.body
        assert caught.value.status_code == 400 and error["code"] == "content_policy_violation"
        assert error["param"] is None and "safety checker" in error["message"]
    assert pngs(settings.outputs_dir) == [] and set(pngs(temp)) == before  # nothing written, anywhere
    assert app.manager.status().safety["flagged"] == 3
    assert metric(app, 'neuron_app_safety_images_total{result="flagged"}') == 3
    assert metric(app, 'neuron_app_requests_total{result="refused"}') == 3


def test_a_classifier_that_cannot_load_fails_the_request_before_device_work(
    make_settings: Callable[..., Any], tmp_path: Path
) -> None:
    """Fail closed: no unchecked image leaves, and nothing was compiled or generated for the request."""
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.errors import ModelLoadError

    manager = PipelineManager(make_settings(safety_checker="on", safety_model=str(tmp_path / "no-such-model")))
    with pytest.raises(ModelLoadError, match=r"the safety checker's model .* could not be loaded"):
        manager.generate("a calm lake", "64x64", 2, 1)
    assert manager.counter.graphs == 0 and manager.status().shapes["64x64"].hits == 0


def test_no_step_preview_leaves_before_the_check(make_settings: Callable[..., Any]) -> None:
    """Live previews are pictures of the image before it is checked: with the checker on, none are sent."""
    from dataclasses import replace

    from neuron_app.engine.manager import PipelineManager
    from neuron_app.engine.modes.previews import PreviewEvent

    manager = PipelineManager(make_settings(**SAFE))
    events: list[Any] = []
    record = manager.run(replace(manager.validate("a calm lake", "64x64", 2, 1), previews=True), progress=events.append)
    assert record.safety == "passed" and [e.step for e in events if e.phase == "denoising"] == [1, 2]
    assert not any(isinstance(e, PreviewEvent) for e in events)


def test_a_checker_that_cannot_load_shows_at_start_and_refuses_at_once_in_full(
    make_settings: Callable[..., Any], tmp_path: Path
) -> None:
    """`on` loads the classifier at start: its failure is in status and on the page before any click, and every
    request is refused at once (no model load, no second try) with the whole message, not one cut mid-word."""
    import time

    from neuron_app.engine.manager import PipelineManager
    from neuron_app.errors import ModelLoadError
    from neuron_app.web.page.views import safety_markdown
    from tests.support import wait_for

    empty = tmp_path / ("an-empty-folder-with-a-long-name-" + "x" * 150)
    empty.mkdir()
    manager = PipelineManager(make_settings(safety_checker="on", safety_model=str(empty)))
    assert manager.status().safety["error"] is None
    manager.start_warmup()
    error = wait_for(lambda: manager.status().safety["error"], 120, "the safety checker's load error in status")
    assert error.endswith("set safety_model to a local folder, or safety_checker = off"), error
    assert " ..." in error or len(error) < 400  # a long reason is cut between words
    assert f"**not loaded**: {error}" in safety_markdown(manager.status())
    start = time.monotonic()
    with pytest.raises(ModelLoadError) as info:
        manager.generate("a calm lake", "64x64", 2, 1)
    assert str(info.value) == error and not manager.loaded  # refused before the model loads
    assert time.monotonic() - start < 5  # no second try of the load (offline, that is 99 s of retries)


def test_auto_loads_the_checker_in_the_background_at_first_use(make_settings: Callable[..., Any]) -> None:
    """auto (on because others can reach it) loads nothing at start; the first request starts it beside the model
    and its image is still checked."""
    from neuron_app.engine.manager import PipelineManager

    manager = PipelineManager(make_settings(safety_checker="auto", safety_model="tiny", server_name="0.0.0.0"))
    assert manager.safety.enabled and not manager.safety.eager
    manager.start_warmup()
    assert manager.safety._thread is None and manager.safety._loaded is None
    record = manager.generate("a calm lake", "64x64", 1, 1)
    assert record.safety == "passed" and manager.safety._thread is not None
