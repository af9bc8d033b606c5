"""Composition root: settings -> pipeline manager -> UI -> queue -> launch.

Run `python app.py` (settings from settings.toml and NEURON_APP_* variables).
"""

from __future__ import annotations


def main() -> None:
    from neuron_app.server import build_app, configure_logging, launch, prepare_environment, resolve_auth
    from neuron_app.settings import get_settings

    settings = get_settings()
    configure_logging(settings)
    resolve_auth(settings)  # refuse an unprotected public link before loading anything
    prepare_environment(settings)

    from neuron_app.manager import get_manager

    manager = get_manager()
    manager.start_warmup()
    launch(build_app(settings, manager))


if __name__ == "__main__":
    main()
