"""Faults: a compile that raises, a generation that raises, a missing or corrupt model, SIGTERM mid-request.

Each fault costs only what it touches: the failing shape is marked `failed` (and can be retried), the
failing request gets a clear error, the model error is one clear line at start, and a SIGTERM lets the
running request finish before the process exits with its manifest intact. Faults are injected through
real extension points (a registered torch._dynamo backend, a module forward hook, the manager's progress
callback, files on disk, a real signal), never by mocking the manager.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gradio_client import Client
from gradio_client.exceptions import AppError

from neuron_app.engine.manager import PipelineManager
from neuron_app.engine.model.tiny import VARIANTS
from neuron_app.engine.records import ProgressEvent
from neuron_app.errors import GenerationFailed, ModelLoadError, ShuttingDown
from neuron_app.settings import load_settings
from tests.support import PATIENT_HTTP, ROOT, TINY_OVERRIDES, AppProcess, free_port

#: 128x128 is 64 image tokens (8x8 patches of 16 px); the backend below fails that graph.
FAILING_SHAPE, FAILING_TOKENS = "128x128", 64


class FailFirstCompile:
    """A real torch.compile backend: raises for graphs with `tokens` image tokens the first `failures`
    times it is asked to compile them, and otherwise delegates to aot_eager."""

    def __init__(self, tokens: int, failures: int = 1) -> None:
        self.tokens = tokens
        self.failures_left = failures
        self.attempts = 0  # compile requests for the failing token count

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
        # hidden_states and img_ids are (batch, image tokens, channels); weights are 1-D or 2-D.
        if any(getattr(t, "ndim", 0) == 3 and t.shape[1] == self.tokens for t in example_inputs):
            self.attempts += 1
            if self.failures_left > 0:
                self.failures_left -= 1
                raise RuntimeError(f"injected compile failure for {self.tokens} image tokens")
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs, **kwargs)


@pytest.fixture(scope="module")
def failing_backend() -> tuple[str, FailFirstCompile]:
    name = f"fail_first_{uuid.uuid4().hex[:8]}"
    backend = FailFirstCompile(FAILING_TOKENS)
    torch._dynamo.register_backend(backend, name=name)
    return name, backend


@pytest.fixture(scope="module")
def fault_app(launch_tiny: Callable[..., Any], failing_backend: tuple[str, FailFirstCompile]) -> Any:
    """The tiny app compiling through the failing backend, with 64x64 compiled and served once."""
    app = launch_tiny(compile_backend=failing_backend[0])
    app.client = Client(app.url, verbose=False, httpx_kwargs=PATIENT_HTTP)
    app.client.predict("first", "64x64", 4, 0, api_name="/generate")
    return app


def _shape(client: Client, name: str) -> dict[str, Any]:
    return client.predict(api_name="/status")["shapes"][name]


# --- (a) a compile that raises ----------------------------------------------------------------------


def test_failed_compile_marks_shape_failed_others_serve_and_retry_works(
    fault_app: Any, failing_backend: tuple[str, FailFirstCompile]
) -> None:
    """A compile error fails that shape only: the client gets "compiling 128x128 failed: ..." , the status
    shows `failed` with the error, 64x64 keeps serving without compiling, and the next request for 128x128
    retries the compile, succeeds, and the shape becomes ready."""
    client, backend = fault_app.client, failing_backend[1]
    with pytest.raises(AppError, match=f"compiling {FAILING_SHAPE} failed: .*injected compile failure"):
        client.predict("x", FAILING_SHAPE, 4, 0, api_name="/generate")
    status = client.predict(api_name="/status")
    failed = status["shapes"][FAILING_SHAPE]
    assert failed["state"] == "failed"
    assert "injected compile failure for 64 image tokens" in failed["last_error"]
    assert status["compile_failures"] == 1
    assert status["shapes"]["64x64"]["state"] == "ready"

    graphs = status["compiles"]
    _path, info = client.predict("still serving", "64x64", 4, 1, api_name="/generate")
    assert info["compiled"] is False and info["cache"] == "memory"

    _path, info = client.predict("retry", FAILING_SHAPE, 4, 0, api_name="/generate")
    assert info["compiled"] is True and info["resolution"] == FAILING_SHAPE
    assert backend.attempts == 2
    retried = _shape(client, FAILING_SHAPE)
    assert (retried["state"], retried["last_error"]) == ("ready", None)
    assert client.predict(api_name="/status")["compiles"] == graphs + 1


# --- (b) an exception inside generation --------------------------------------------------------------


def test_out_of_memory_in_decode_fails_that_request_only(fault_app: Any) -> None:
    """A torch.OutOfMemoryError raised inside the VAE decoder (a forward pre-hook: a real extension point)
    fails that request with "generation failed: OutOfMemoryError: ..."; the shape stays ready, nothing
    recompiles, the hit is not counted, and the next request succeeds."""
    client, manager = fault_app.client, fault_app.manager

    def out_of_memory(_module: torch.nn.Module, _args: Any) -> None:
        raise torch.OutOfMemoryError("out of memory: tried to allocate 20.00 GiB")

    before = client.predict(api_name="/status")
    handle = manager.pipe.vae.decoder.register_forward_pre_hook(out_of_memory)
    try:
        with pytest.raises(AppError, match="generation failed: OutOfMemoryError: out of memory"):
            client.predict("x", "64x64", 4, 0, api_name="/generate")
    finally:
        handle.remove()
    after = client.predict(api_name="/status")
    assert after["shapes"]["64x64"]["state"] == "ready"
    assert after["shapes"]["64x64"]["hits"] == before["shapes"]["64x64"]["hits"]
    assert after["compiles"] == before["compiles"]
    _path, info = client.predict("after the fault", "64x64", 4, 0, api_name="/generate")
    assert info["compiled"] is False


def test_error_in_step_callback_fails_that_request_only(fault_app: Any) -> None:
    """An exception raised from the manager's progress callback in the middle of denoising (the pipeline's
    step-end hook calls it) becomes GenerationFailed for that call; the device is free again at once."""
    manager: PipelineManager = fault_app.manager

    def fail_at_step_2(event: ProgressEvent) -> None:
        if event.phase == "denoising" and event.step == 2:
            raise RuntimeError("client went away at step 2")

    with pytest.raises(GenerationFailed, match="generation failed: RuntimeError: client went away at step 2"):
        manager.generate("x", "64x64", 4, 0, progress=fail_at_step_2)
    record = manager.generate("x", "64x64", 4, 0)
    assert record.image.size == (64, 64) and not record.compiled


# --- (c) a missing or corrupt model --------------------------------------------------------------------


def test_missing_model_folder_is_a_clear_error(tmp_path: Path) -> None:
    """A model path that does not exist is refused when the manager is built, naming the path."""
    missing = tmp_path / "no-such-model"
    settings = load_settings(**(TINY_OVERRIDES | {"model": str(missing), "cache_dir": tmp_path / "cache"}))
    with pytest.raises(ModelLoadError, match=re.escape(f"model folder {missing} does not exist")):
        PipelineManager(settings)


def test_corrupt_model_index_is_a_clear_error(tmp_path: Path) -> None:
    """A folder whose model_index.json is not JSON is refused when the manager is built."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model_index.json").write_text('{"_class_name": "Flux2KleinPipeline", ')
    settings = load_settings(**(TINY_OVERRIDES | {"model": str(broken), "cache_dir": tmp_path / "cache"}))
    with pytest.raises(ModelLoadError, match=r"model_index\.json is unreadable"):
        PipelineManager(settings)


def test_corrupt_weights_fail_the_load_clearly_and_can_be_retried(tmp_path: Path, shared_models: Path) -> None:
    """A pipeline folder with truncated transformer weights: loading raises ModelLoadError naming the
    folder, the status shows the load error (not stuck on `loading`), and a second try raises again."""
    model = tmp_path / "model"
    shutil.copytree(shared_models / VARIANTS["tiny"].folder_name, model)
    weights = model / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    manager = PipelineManager(load_settings(**(TINY_OVERRIDES | {"model": str(model), "cache_dir": tmp_path / "c"})))
    for _ in range(2):
        with pytest.raises(ModelLoadError, match=re.escape(f"could not load the pipeline from {model}")):
            manager.ensure_loaded()
        status = manager.status()
        assert (status.loaded, status.loading) == (False, False)
        assert status.load_error and "could not load the pipeline from" in status.load_error


@pytest.mark.parametrize("kind", ["missing", "corrupt-index"])
def test_app_py_start_up_model_error_is_one_clear_line(tmp_path: Path, kind: str) -> None:
    """`python app.py` with a missing or corrupt model folder exits with code 2 and one clear "error: ..."
    line, no traceback, before the server starts."""
    model = tmp_path / "model"
    if kind == "corrupt-index":
        model.mkdir()
        (model / "model_index.json").write_text("not json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_APP_")}
    env |= {"NEURON_APP_MODEL": str(model), "NEURON_APP_DEVICE": "cpu", "NEURON_APP_CACHE_DIR": str(tmp_path / "c")}
    env["NEURON_APP_SERVER_PORT"] = str(free_port())  # 7860 may be taken: the port is checked first
    done = subprocess.run(
        [sys.executable, str(ROOT / "app.py")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "Traceback" not in output
    expected = "does not exist" if kind == "missing" else "model_index.json is unreadable"
    assert f"error: model folder {model}" in done.stderr and expected in done.stderr


# --- (d) SIGTERM while a request runs ---------------------------------------------------------------------


def test_drain_waits_for_work_in_flight_then_refuses_new_work(make_settings: Callable[..., Any]) -> None:
    """`drain` (what SIGTERM calls) refuses new generate/compile calls with "the server is shutting down"
    before any model work, returns False while a call is still in flight past the timeout, and True once
    it has left. The in-flight call is held by its own progress callback at the "loading" event."""
    manager = PipelineManager(make_settings())
    entered, release = threading.Event(), threading.Event()

    def hold(event: ProgressEvent) -> None:
        entered.set()
        release.wait(30)
        raise RuntimeError("released")

    errors: list[BaseException] = []
    worker = threading.Thread(
        target=lambda: _capture(lambda: manager.generate("x", "64x64", 4, 0, progress=hold), errors), daemon=True
    )
    worker.start()
    assert entered.wait(30)
    assert manager.drain(0.2) is False and manager.draining
    with pytest.raises(ShuttingDown, match="the server is shutting down; try again in a moment"):
        manager.generate("x", "64x64", 4, 0)
    with pytest.raises(ShuttingDown):
        manager.compile_shape("64x64")
    release.set()
    assert manager.drain(30) is True
    worker.join(30)
    assert [str(e) for e in errors] == ["released"]
    assert not manager.loaded and manager.counter.graphs == 0


def _capture(call: Callable[[], Any], errors: list[BaseException]) -> None:
    try:
        call()
    except Exception as exc:
        errors.append(exc)


def test_sigterm_lets_the_running_request_finish_then_exits_cleanly(run_app_py: Callable[..., AppProcess]) -> None:
    """SIGTERM during a request (here: the first one, which loads, compiles and runs 60 steps): a request
    sent after the signal is refused ("shutting down"), the running one completes and reaches its client,
    then the process exits 0 within the grace period, with a valid manifest recording the compiled shape."""
    app = run_app_py(resolutions=["64x64"], max_steps=100, shutdown_grace_s=60, log_level="INFO")
    app.wait_up()
    client = Client(app.url, verbose=False, httpx_kwargs=PATIENT_HTTP)
    running = client.submit("long", "64x64", 60, 0, api_name="/generate")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until the request holds the device (loading or compiling)
        status = client.predict(api_name="/status")
        if status["loading"] or status["loaded"]:
            break
        time.sleep(0.05)
    assert not running.done(), "the request finished before the signal: make it longer"
    app.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()

    refused: list[BaseException] = []
    late = threading.Thread(target=lambda: _expect_error(client, refused), daemon=True)
    time.sleep(0.3)  # the handler has started draining
    late.start()

    _path, info = running.result(timeout=90)
    assert (info["steps"], info["compiled"]) == (60, True)
    assert app.proc.wait(timeout=60) == 0, app.output()[-3000:]
    assert time.monotonic() - signalled < 60
    late.join(timeout=30)
    assert refused and "shutting down" in str(refused[0])

    manifest = json.loads((app.cache_dir / "manifest.json").read_text())
    assert manifest["version"] == 1 and set(manifest["entries"]) == {"64x64"}
    output = app.output()
    assert "SIGTERM received" in output and "server closed" in output
    assert "Traceback" not in output
    # what it waits for, step by step, and the app's own share hint instead of Gradio's
    assert "waiting up to 60 s for 1 running or waiting request(s)" in output
    assert "shutdown: closing the web server" in output and "exiting with code 0" in output
    assert "NEURON_APP_SHARE=true" in output and "share=True` in `launch()`" not in output


def _expect_error(client: Client, errors: list[BaseException]) -> None:
    try:
        client.predict("late", "64x64", 4, 0, api_name="/generate")
    except Exception as exc:  # the refusal, or the connection closing if the server is already gone
        errors.append(exc)
