"""Wiring for the web server: environment, auth policy, the Gradio queue, launch and graceful shutdown."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from neuron_app import tracing
from neuron_app.engine.contract import Manager
from neuron_app.errors import AppError, SettingsError
from neuron_app.settings import Settings

log = logging.getLogger(__name__)

#: After the last request finished, time for Gradio to send its answer before the server closes.
SHUTDOWN_FLUSH_S = 0.5
#: Exit codes of `python app.py`: a signal-driven shutdown that cut nothing off, one that did, bad settings.
EXIT_OK, EXIT_CUT_OFF, EXIT_CONFIG = 0, 1, 2


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


def check_port(settings: Settings) -> None:
    """Refuse a port in use before the heavy imports (seconds each try), naming the setting that moves it: Gradio's
    own traceback would suggest GRADIO_SERVER_PORT, which the app overrides."""
    import socket

    host, port = settings.server_name, settings.server_port
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError:
        return  # an unresolvable name: Gradio's bind says so
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            probe.bind(address)
        except OSError:
            raise SettingsError(
                f"port {port} on {host} is in use: set NEURON_APP_SERVER_PORT to a free port, keeping the rest "
                f"of this start, e.g. {same_start_on(port + 1 if port < 65535 else port - 1)}"
            ) from None


def same_start_on(port: int) -> str:
    """This process's own command line with another port: a hint that drops `NEURON_APP_SETTINGS` (or any other
    variable set for this one command) would start a different app (the quick start's became the 4B model).
    Secret variables are named, not repeated."""
    import shlex

    from neuron_app.settings import ENV_PREFIX, SECRET_FIELDS

    secret = {ENV_PREFIX + name.upper() for name in SECRET_FIELDS}
    kept, hidden = [], []
    for name, value in sorted(os.environ.items()):
        if not name.startswith(ENV_PREFIX) or name == "NEURON_APP_SERVER_PORT":
            continue
        (hidden if name in secret else kept).append(f"{name}={shlex.quote(value)}" if name not in secret else name)
    argv = sys.argv or ["app.py"]
    if argv[0].endswith("__main__.py"):
        command = ["python", "-m", "neuron_app", *argv[1:]]
    else:
        script = os.path.relpath(argv[0]) if os.path.isabs(argv[0]) and argv[0].startswith(os.getcwd()) else argv[0]
        command = ["python", script, *argv[1:]]
    words = [*kept, f"NEURON_APP_SERVER_PORT={port}", shlex.join(command)]
    also = f" (with {', '.join(hidden)} set as now)" if hidden else ""
    return " ".join(words) + also


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
    manager: Manager
    demo: Any
    ops: Any = None  # neuron_app.web.ops.Ops: /healthz, /readyz, /metrics on the same server
    closers: list[Callable[[], None]] = field(default_factory=list)  # run by `shutdown` (the job store's close)


def build_app(settings: Settings, manager: Manager) -> App:
    """The Blocks with its queue: one device lane, bounded waiting room."""
    import gradio as gr

    from neuron_app.engine.output.images import ImageStore
    from neuron_app.engine.output.postprocess import request_slots
    from neuron_app.engine.trust.marks import Marker
    from neuron_app.web.access import Access
    from neuron_app.web.mcp.cancel_tool import add_cancel_job
    from neuron_app.web.openai.routes import OpenAIImages
    from neuron_app.web.ops import Ops
    from neuron_app.web.page.ui import build_ui

    # Images are written once and served from where they are: Gradio neither hashes nor copies them into its
    # own cache on every answer (a few ms per request, and a second copy on disk). The folder was already
    # downloadable (`allowed_paths`); ImageStore keeps it bounded.
    gr.set_static_paths([settings.outputs_dir])
    access = Access(settings)  # API keys, per-key and per-address limits, their counts (one per app)
    tracing.setup(settings)  # OpenTelemetry, only with an endpoint set (neuron_app/tracing.py)
    # Every image is marked as AI-made (watermark, IPTC, signed C2PA): the signer is checked here, at start.
    marker = Marker.for_settings(settings)
    # The OpenAI API first: its usage book (in the state folder it holds) books the page's images too.
    openai_api = OpenAIImages(settings, manager, None, access)
    demo = build_ui(manager, ImageStore(settings.outputs_dir, marker=marker), access, openai_api.usage)
    # Each device lane's next request starts while the last one's image is in a post slot (output/postprocess.py).
    demo.queue(max_size=settings.queue_max_size, default_concurrency_limit=request_slots(settings))
    openai_api.demo = demo
    add_cancel_job(demo, openai_api.jobs)  # the MCP tool cancel_job (web/mcp/cancel_tool.py)
    ops = Ops(settings, manager, demo, extra_routes=openai_api.routes(), extra_waiting=lambda: openai_api.in_flight)
    ops.metrics.registry.register(access)  # its counts on /metrics, read at scrape time
    ops.metrics.registry.register(openai_api.usage.collector())  # usage per key today, read at scrape time
    return App(settings, manager, demo, ops, closers=[openai_api.jobs.close])


def mcp_enabled(settings: Settings) -> bool:
    """Gradio's MCP endpoint has no login of its own: it is served only while the page has no auth."""
    if settings.mcp_server and settings.auth is not None:
        log.warning("mcp_server is off: the page has basic auth and Gradio's MCP endpoint cannot ask for it")
        return False
    return settings.mcp_server


def launch(app: App, *, block: bool = True, quiet: bool = False, **overrides: Any) -> Any:
    settings = app.settings
    kwargs: dict[str, Any] = {
        "server_name": settings.server_name,
        "server_port": settings.server_port,
        "share": settings.share,
        "auth": resolve_auth(settings),
        "prevent_thread_lock": True,
        "allowed_paths": [str(settings.outputs_dir)],
        "show_error": False,
        "max_file_size": int(settings.max_upload_mb * 1024 * 1024),
        "quiet": True,  # Gradio's own lines would say "set share=True in launch()": `announce` says the app's way
        "app_kwargs": door_kwargs(app),
        "mcp_server": mcp_enabled(settings),
        "enable_monitoring": False,  # Gradio's /monitoring told anyone every function's counts and timings
        "run_history": settings.run_history_on,  # off where others can reach it, unless chosen (docs/sharing.md)
        "_frontend": False,  # Gradio's own check of its page gives up too soon on a busy host: `wait_for_page`
        "css": getattr(app.demo, "page_css", None),  # the page's own layout fixes (web/page/ui.py)
    }
    kwargs.update(overrides)
    result = app.demo.launch(**kwargs)
    if not kwargs["share"]:
        wait_for_page(app.demo.local_url)
    from neuron_app.web.door.aliases import Aliases
    from neuron_app.web.mcp.tools import mend

    aliases = Aliases.for_settings(settings)
    mend(app.demo, aliases.local_path, aliases.public_path)  # MCP answers: JSON, a preview and a link, no paths
    from neuron_app.web.gradio_errors import mend_error_payload

    mend_error_payload()  # Gradio's own refusals say what was wrong, in one line, instead of {"error": null}

    guard_connections(app.demo, settings)  # a header deadline; requests in progress capped by web/guard.py
    from neuron_app.web.page.first_render import install

    install(app.demo)  # every page opens on the state of now, not the state at launch
    if not quiet:
        print(announce(app.demo, settings), flush=True)
    if block:
        app.demo.block_thread()
    return result


#: How long the page may take to answer its first request after the server started.
PAGE_ANSWER_S = 120.0


def wait_for_page(url: str, timeout_s: float = PAGE_ANSWER_S) -> None:
    """Gradio 6.31 checks that its page answers with one HEAD request and a 3 s timeout (its `url_ok`); a first
    render slower than that (a busy host: seen in a full test run beside two CPU hogs) made it raise "When
    localhost is not accessible, a shareable link must be created". Any answer means localhost is reachable."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            httpx.head(url, timeout=10.0)
            return
        except httpx.HTTPError as exc:
            if time.monotonic() > deadline:
                raise AppError(f"the page at {url} did not answer within {timeout_s:.0f} s: {exc}") from None
            time.sleep(0.5)


def door_kwargs(app: App) -> dict[str, Any]:
    """Gradio's FastAPI keyword arguments: our routes (web/ops.py) and the door every request meets (web/door/)."""
    from starlette.middleware import Middleware

    from neuron_app.web.door.middleware import Door
    from neuron_app.web.guard import Guard

    kwargs = app.ops.app_kwargs() if app.ops is not None else {}
    guard, door = Middleware(Guard, settings=app.settings), Middleware(Door, settings=app.settings)
    return kwargs | {"middleware": [guard, door]}  # the first is the outermost


def announce(demo: Any, settings: Settings) -> str:
    """Where the page runs, and how this app shares it (Gradio prints the public URL itself when shared)."""
    lines = [f"* Running on local URL:  {demo.protocol}://{demo.server_name}:{demo.server_port}"]
    if not getattr(demo, "share_url", None):
        lines.append(
            "* No public link. To open one, set NEURON_APP_SHARE=true with NEURON_APP_AUTH_USERNAME and"
            " NEURON_APP_AUTH_PASSWORD (docs/deploy-trn.md, Share link and authentication)."
        )
    return "\n".join(lines)


def _wait_for_gradio(demo: Any, deadline: float) -> bool:
    """Wait until Gradio's queue holds no waiting or running event, then let it send the last answers."""
    from neuron_app.web.ops import gradio_queue_length

    while time.monotonic() < deadline:
        length = gradio_queue_length(demo)
        if not length:  # 0, or None: the queue is not reachable (not launched, or a Gradio upgrade)
            time.sleep(min(SHUTDOWN_FLUSH_S, max(0.0, deadline - time.monotonic())))
            return True
        time.sleep(0.05)
    return False


def shutdown(app: App, grace_s: float) -> bool:
    """Drain and close: new generations are refused ("the server is shutting down"), the running one gets
    up to `grace_s` seconds to finish and be delivered, then the server closes.

    Returns True when nothing was cut off. The manifest is never left half-written: compiles record it
    inside the device work that `drain` waits for, and its writes are atomic.
    """
    deadline = time.monotonic() + grace_s
    running = app.manager.in_flight
    log.warning(
        "shutting down: refusing new requests; waiting up to %.0f s for %d running or waiting request(s)",
        grace_s,
        running,
    )
    idle = app.manager.drain(grace_s)
    log.info("shutdown: waiting for the page's queue to deliver its last answers")
    delivered = _wait_for_gradio(app.demo, deadline)
    if not (idle and delivered):
        log.error("shutdown grace period of %.0f s ran out with requests still running; they are cut off", grace_s)
    log.info("shutdown: closing the web server")
    app.demo.close()
    for close in app.closers:  # the job store: its WAL checkpointed into the database
        close()
    log.info("shutdown: releasing the manager (replicas and the Ray instance the app started, if any)")
    app.manager.close()
    log.warning("server closed")
    return idle and delivered


def install_signal_handlers(
    app: App, grace_s: float, signals: Iterable[signal.Signals] = (signal.SIGTERM, signal.SIGINT)
) -> None:
    """On SIGTERM (or Ctrl-C): `shutdown`, then exit with EXIT_OK (or EXIT_CUT_OFF if the grace period ran out).

    A second signal while draining exits at once. Call from the main thread, before `launch`.
    """
    stopping = threading.Event()

    def handle(signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if stopping.is_set():
            log.error("%s again while shutting down: exiting now", name)
            os._exit(EXIT_CUT_OFF)
        stopping.set()
        log.warning("%s received", name)
        code = EXIT_OK if shutdown(app, grace_s) else EXIT_CUT_OFF
        log.warning("exiting with code %d", code)
        exit_now(code)

    for sig in signals:
        signal.signal(sig, handle)


def starting_line(settings: Settings) -> str:
    """What `python app.py` prints first, before its imports: the model, the address, and what to wait for."""
    host = "127.0.0.1" if settings.server_name in ("0.0.0.0", "::") else settings.server_name
    then = "then loads the model" if settings.load_on_start else "loads the model on the first request"
    warm = f", then warms up ({settings.warmup})" if settings.warmup != "none" else ""
    return (
        f"starting {settings.model} on http://{host}:{settings.server_port}/ : the page answers in seconds to a "
        f"minute, {then}{warm}; GET /readyz answers 200 when it serves"
    )


def exit_now(code: int) -> None:
    """Exit once everything is saved and closed (`shutdown`): the traces flushed, the logs written, then no
    interpreter teardown, which unloading torch, its compile workers and the model made 20 s after Ctrl-C at a
    load of 10 (turn 7's T7-11)."""
    tracing.shutdown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_main(main: Callable[[], None]) -> int:
    """Run the entry point; the app's own start-up errors (bad settings, no device, an unloadable model) print one
    clear line (no traceback), exit 2."""
    try:
        main()
    except AppError as exc:
        if exc.kind == "failed":
            raise
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    return EXIT_OK


def guard_connections(demo: Any, settings: Settings) -> type:
    """On the launched server: the header deadline and cap on every new connection, and uvicorn's connection cap
    off (Guard counts requests in progress instead). Without httptools (or with a protocol this does not know)
    the deadline is on uvicorn's h11 protocol; a server that is not uvicorn's is refused: never unprotected."""
    config = getattr(getattr(demo, "server", None), "config", None)
    if config is None or not hasattr(config, "http_protocol_class"):
        raise AppError("the web server is not uvicorn's: the header deadline cannot be set")
    config.limit_concurrency = None
    from uvicorn.protocols.http.h11_impl import H11Protocol

    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        known: tuple[type, ...] = (HttpToolsProtocol, H11Protocol)
    except ImportError:  # httptools is in requirements-common.txt; uvicorn alone runs on h11
        known = (H11Protocol,)
    current = getattr(config, "http_protocol_class", None)
    if not (isinstance(current, type) and issubclass(current, known)):
        log.warning("uvicorn's protocol %r is not one the header deadline knows: serving with h11", current)
        current = H11Protocol
    from neuron_app.web.guard import header_deadline

    config.http_protocol_class = header_deadline(
        current, settings.header_timeout_s, settings.max_header_kb << 10, settings.send_timeout_s
    )
    return config.http_protocol_class
