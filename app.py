"""Composition root: settings -> pipeline manager -> UI -> queue -> launch, on every path.

Run `python app.py` (settings from settings.toml and NEURON_APP_* variables); under
`torchrun --nproc_per_node=N app.py` rank 0 serves the same page (`serve_page`) over the tensor-parallel group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def prepare_page(settings: Any) -> None:
    """Before anything loads: refuse an unprotected public link, and set what Gradio reads at import."""
    from neuron_app.web.server import prepare_environment, resolve_auth

    resolve_auth(settings)
    prepare_environment(settings)


def serve_page(manager: Any) -> Callable[[float], bool]:
    """Start the page on `manager` (not blocking); returns its stop: drain for up to the seconds given, close."""
    from neuron_app.web.server import build_app, launch, shutdown

    app = build_app(manager.settings, manager)
    launch(app, block=False)

    def stop(grace_s: float) -> bool:
        drained = shutdown(app, grace_s)
        app.ops.close()
        return drained

    return stop


def main() -> None:
    from neuron_app.environment import launched_by_torchrun, prepare_process
    from neuron_app.scale.distributed import serve_distributed
    from neuron_app.scale.tp_startup import check_single_process

    if launched_by_torchrun():  # `torchrun --nproc_per_node=N app.py`: tensor-parallel ranks in lockstep
        raise SystemExit(serve_distributed(serve_page, prepare_page))

    from neuron_app import tracing
    from neuron_app.scale.topology import settle
    from neuron_app.settings import get_settings
    from neuron_app.web.server import build_app, check_port, configure_logging, launch, starting_line

    settings = settle(get_settings())  # the topology, chosen once, before any replica starts (scale/topology.py)
    check_single_process(settings)  # one TP group without replicas needs torchrun
    configure_logging(settings)
    prepare_process(settings)  # NEFF cache, fallback switches, cores: before anything imports torch
    prepare_page(settings)
    check_port(settings)  # a port in use is one line now, not a traceback after the imports
    tracing.check_installed(settings)  # a trace endpoint without OpenTelemetry installed: one line, now
    # A first line at once: the imports and the page take seconds to minutes on a busy machine, silent until now.
    print(starting_line(settings), flush=True)

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
