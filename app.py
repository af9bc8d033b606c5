"""Composition root: settings -> pipeline manager -> UI -> queue -> launch.

Run `python app.py` (settings from settings.toml and NEURON_APP_* variables).
"""

from __future__ import annotations


def main() -> None:
    from neuron_app.scale.distributed import check_single_process, launched_by_torchrun, serve_distributed

    if launched_by_torchrun():  # `torchrun --nproc_per_node=N app.py`: tensor-parallel ranks in lockstep
        raise SystemExit(serve_distributed())

    from neuron_app.environment import prepare_process
    from neuron_app.settings import get_settings
    from neuron_app.web.server import build_app, configure_logging, launch, prepare_environment, resolve_auth

    settings = get_settings()
    check_single_process(settings)  # tp_degree > 1 needs torchrun
    configure_logging(settings)
    prepare_process(settings)  # NEFF cache, fallback switches, cores: before anything imports torch
    resolve_auth(settings)  # refuse an unprotected public link before loading anything
    prepare_environment(settings)

    from neuron_app.scale import make_manager
    from neuron_app.web.server import install_signal_handlers

    manager = make_manager(settings)  # in-process, or Ray Serve replicas when replicas > 1 / ray_address
    app = build_app(settings, manager)
    install_signal_handlers(app, settings.shutdown_grace_s)  # SIGTERM: finish running requests, then exit
    launch(app, block=False)
    manager.start_warmup()  # after the page is up: loading and compiling never delay it
    app.demo.block_thread()


if __name__ == "__main__":
    from neuron_app.web.server import run_main

    raise SystemExit(run_main(main))
