"""Shared fixtures: the real tiny FLUX.2-klein on CPU, a manager, and a launched app.

Everything runs the project's real code; compile tests use `aot_eager` (seconds) unless the
persistent disk cache is the point, where they use `inductor`.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Before gradio is imported anywhere: its temp folder, no analytics; no NEURON_APP_* leaks in.
_SESSION_TMP = Path(tempfile.mkdtemp(prefix="neuron-app-tests-"))
os.environ["GRADIO_TEMP_DIR"] = str(_SESSION_TMP / "gradio")
os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
for _key in [k for k in os.environ if k.startswith("NEURON_APP_")]:
    del os.environ[_key]
sys.path.insert(0, str(ROOT))

#: Small shapes: 64x64 (16 tokens), 128x64 and its transpose (32 tokens each), 128x128 (64 tokens).
TEST_SHAPES = ["64x64", "128x64", "64x128", "128x128"]
TINY_OVERRIDES: dict[str, Any] = {
    "model": "tiny",
    "device": "cpu",
    "compile_backend": "aot_eager",
    "resolutions": TEST_SHAPES,
    "default_resolution": "64x64",
    "max_sequence_length": 32,
    "max_steps": 8,
}


@pytest.fixture(scope="session")
def shared_models() -> Path:
    """One tiny model build per session; each test's cache folder links to it."""
    from neuron_app.tiny import ensure_tiny

    models = _SESSION_TMP / "models"
    ensure_tiny(models, "tiny")
    return models


def link_models(cache_dir: Path, models: Path) -> Path:
    cache_dir.mkdir(parents=True, exist_ok=True)
    link = cache_dir / "models"
    if not link.exists():
        link.symlink_to(models, target_is_directory=True)
    return cache_dir


@pytest.fixture
def make_settings(tmp_path: Path, shared_models: Path) -> Callable[..., Any]:
    """Tiny-model settings in a fresh cache folder; keyword arguments override."""
    from neuron_app.settings import load_settings

    def make(**overrides: Any) -> Any:
        cache_dir = overrides.pop("cache_dir", tmp_path / "cache")
        link_models(Path(cache_dir), shared_models)
        return load_settings(**(TINY_OVERRIDES | {"cache_dir": cache_dir} | overrides))

    return make


@pytest.fixture(scope="module")
def module_manager(tmp_path_factory: pytest.TempPathFactory, shared_models: Path) -> Any:
    """A loaded tiny manager shared by a module's tests (compile state accumulates)."""
    from neuron_app.manager import PipelineManager
    from neuron_app.settings import load_settings

    cache_dir = link_models(tmp_path_factory.mktemp("cache"), shared_models)
    manager = PipelineManager(load_settings(**(TINY_OVERRIDES | {"cache_dir": cache_dir})))
    manager.ensure_loaded()
    return manager


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def launched_app(tmp_path_factory: pytest.TempPathFactory, shared_models: Path) -> Iterator[Any]:
    """The real app (tiny model, aot_eager) launched without blocking on a free local port."""
    from neuron_app.manager import PipelineManager
    from neuron_app.server import build_app, launch
    from neuron_app.settings import load_settings

    cache_dir = link_models(tmp_path_factory.mktemp("appcache"), shared_models)
    settings = load_settings(**(TINY_OVERRIDES | {"cache_dir": cache_dir, "server_port": free_port()}))
    app = build_app(settings, PipelineManager(settings))
    launch(app, block=False)
    app.url = f"http://127.0.0.1:{settings.server_port}/"
    yield app
    app.demo.close()


@pytest.fixture(scope="module")
def client(launched_app: Any) -> Any:
    from gradio_client import Client

    return Client(launched_app.url, verbose=False)
