"""Wiring for the web server: environment, auth policy, the Gradio queue and launch."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from neuron_app.settings import Settings, SettingsError

log = logging.getLogger(__name__)

#: Gradio's temporary files older than this are deleted, checked as often (seconds).
TEMP_FILE_MAX_AGE_S = 3600


def configure_logging(settings: Settings) -> None:
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def prepare_environment(settings: Settings) -> None:
    """Environment that must be set before gradio is imported: its temp folder and analytics."""
    temp = settings.cache_dir / "gradio-tmp"
    temp.mkdir(parents=True, exist_ok=True)
    os.environ["GRADIO_TEMP_DIR"] = str(temp)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


def resolve_auth(settings: Settings) -> tuple[str, str] | None:
    """Basic auth from the environment; a public share link needs it unless explicitly waived."""
    auth = settings.auth
    if settings.share and auth is None:
        if not settings.allow_public_without_auth:
            raise SettingsError(
                "share=true opens a public link: set NEURON_APP_AUTH_USERNAME and NEURON_APP_AUTH_PASSWORD, "
                "or NEURON_APP_ALLOW_PUBLIC_WITHOUT_AUTH=true to serve it to anyone"
            )
        log.warning("!!! share=true WITHOUT authentication: anyone with the link can use this server !!!")
    return auth


@dataclass
class App:
    settings: Settings
    manager: Any
    demo: Any


def build_app(settings: Settings, manager: Any) -> App:
    """The Blocks with its queue: one device lane, bounded waiting room."""
    from neuron_app.images import ImageStore
    from neuron_app.ui import build_ui

    demo = build_ui(manager, ImageStore(settings.cache_dir / "outputs"))
    demo.queue(max_size=settings.queue_max_size, default_concurrency_limit=settings.concurrency_limit)
    return App(settings, manager, demo)


def launch(app: App, *, block: bool = True, **overrides: Any) -> Any:
    settings = app.settings
    kwargs: dict[str, Any] = {
        "server_name": settings.server_name,
        "server_port": settings.server_port,
        "share": settings.share,
        "auth": resolve_auth(settings),
        "prevent_thread_lock": not block,
        "allowed_paths": [str(settings.cache_dir / "outputs")],
        "show_error": False,
        "quiet": False,
    }
    kwargs.update(overrides)
    return app.demo.launch(**kwargs)
