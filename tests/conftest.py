"""Shared fixtures: the real tiny FLUX.2-klein on CPU, a manager, and a launched app. Helpers that test
modules import live in tests/support.py.

Everything runs the project's real code; compile tests use `aot_eager` (seconds) unless the
persistent disk cache is the point, where they use `inductor`.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Under pytest-xdist (`-n 2`, opt-in) each worker's torch, and every process a test starts,
# gets one intra-op thread: two workers of two spinning OpenMP threads each spent a third more CPU for the same
# work. Set before numpy or torch is imported (they read it once).
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import pytest

from tests.support import PATIENT_HTTP, ROOT, TINY_OVERRIDES, AppProcess, free_port, link_models

# Before gradio is imported anywhere: its temp folder, no analytics; no NEURON_APP_* leaks in.
# This process's folder (the tiny models, Gradio's files, the emulated cores) goes when the process does: every run
# left three behind (the controller's and two workers'), 638 MB in 259 folders on this machine. xdist ends a worker
# before its exit handlers run, so a worker's folder lies inside the controller's (named by an inherited variable),
# which the controller removes after its workers have ended.
_PARENT_TMP = os.environ.get(_PARENT_TMP_VAR := "NEURON_TESTS_SESSION_TMP")
if not (_PARENT_TMP and os.path.isdir(_PARENT_TMP)):
    _PARENT_TMP = None
_SESSION_TMP = Path(tempfile.mkdtemp(prefix="neuron-app-tests-", dir=_PARENT_TMP))
if _PARENT_TMP is None:
    os.environ[_PARENT_TMP_VAR] = str(_SESSION_TMP)
    # Ray's session folders (every cluster a test starts: `ray start`, the app's own `ray.init`) went to /tmp/ray,
    # about 7 per run, never removed. Here they go with the session ("<this folder>/ray"), where the path leaves
    # room for Ray's sockets (an AF_UNIX path is at most 107 bytes; Ray's add about 70 below this folder).
    if len(str(_SESSION_TMP)) <= 36:
        os.environ["RAY_TMPDIR"] = str(_SESSION_TMP)
atexit.register(shutil.rmtree, _SESSION_TMP, ignore_errors=True)
# Everything else this process puts in the system's temp folder goes here too: gradio_client makes a folder per
# downloaded file (/tmp/<40 hex>) and leaves it empty when it moves the file out, about 95 a run; pytest's own
# tmp_path folders and a compile that names no cache folder (torchinductor_<user>) went there as well.
tempfile.tempdir = str(_SESSION_TMP)
os.environ["GRADIO_TEMP_DIR"] = str(_SESSION_TMP / "gradio")
os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
# The emulator's NeuronCores are held per machine (neuron_app/backends/emulator/cores.py): this process's tests, and
# each test, get a machine of their own, so that xdist workers and earlier tests' managers hold none of its cores.
os.environ["NEURON_EMULATOR_CORES_DIR"] = str(_SESSION_TMP / "neuron-cores")
for _key in [k for k in os.environ if k.startswith("NEURON_APP_")]:
    del os.environ[_key]
sys.path.insert(0, str(ROOT))

# The router settings the app sets before it imports Ray, set here too: another test module may import ray.serve
# first (Ray reads them once per process).
from neuron_app.scale import set_router_env  # noqa: E402

set_router_env()

#: Modules that start a Ray cluster: under pytest-xdist one worker runs them one after the other (two clusters at
#: once on the 2-core CI host starve each other's replicas past their timeouts).
RAY_MODULES = frozenset({"test_replicas", "test_autoscale", "test_serve_app"})


#: The groups that take longest, heaviest first: worker seconds (setup + call + teardown) from one `--durations=0`
#: run of the whole suite (the README's command) on the quiet 2-core machine (docs/testing.md, stop 64); only their
#: order matters.
#: xdist hands groups out in collection order (with `--no-loadscope-reorder`, set in pyproject.toml; its
#: default orders them by test count), so under `-n` these start first and the short ones fill in around them.
HEAVY_GROUPS = {
    "ray": 355,  # the three Ray modules, one worker, one local cluster
    "test_bench": 196,  # one bench smoke run, 17 processes
    "test_diffusers_klein": 200,  # (an earlier run) diffusers' klein tests twice (plain CPU, emulate), when fetched
    "test_emulate": 189,  # user scripts under emulate, the guide's TP snippets under torchrun (eager, compiled)
    "test_remote_cache": 147,
    "test_selftest": 146,
    "test_real_size": 141,  # klein-4B at its real size: 15 GiB written, 14 GiB resident, two images
    "test_topology": 134,
    "test_distributed": 98,
    "test_precompile": 94,
    "test_browser": 88,
    "test_neuron_emulated": 73,
    "test_train": 63,  # train-tiny, 12 steps a stage
    "test_tiny_shapes": 52,  # two tiny-shapes managers (cpu, neuron-emulated), judged images
    "test_job_store": 48,
    "test_quickstart": 47,
    "test_emulator_rules": 43,
    "test_page_stop": 40,
    "test_plan": 37,  # three plan processes on fake tensors (4B with edits, 9B, LNC=1) and the status line
    "test_jobs": 35,
    "test_manager": 33,
}

#: The two groups that start the run, whatever their figures: the Ray cluster's start-up beside test_real_size's
#: disk work, not beside the bench smoke run's six processes at once (the order of every green pair before stop
#: 64). Ray waits a fixed 30 s for its raylet to register (ray/_private/node.py); two suites side by side ran it
#: out in either order, so a local start that runs out is now made again (neuron_app/scale/local_ray.py).
START_FIRST = ("ray", "test_real_size")


def _heavy_first(group: str) -> tuple[int, float]:
    first = START_FIRST.index(group) if group in START_FIRST else len(START_FIRST)
    return first, -HEAVY_GROUPS.get(group, 0)


def _group(item: pytest.Item) -> str:
    name = item.module.__name__.rsplit(".", 1)[-1] if item.module else item.nodeid
    return "ray" if name in RAY_MODULES else name


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the group markers into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With `-n` (pytest-xdist, `--dist loadgroup`): a module's tests stay in one worker, so its module fixtures
    (a launched app, a Ray cluster) start once; the Ray modules share one worker; the heaviest groups are
    collected first. pytest-randomly has shuffled the modules, and the tests in each, before this hook (its
    wrapper runs first; every worker gets the same seed): the sort is stable, so the heavy groups lead and the order
    is random within each group and among the rest. A serial run keeps randomly's order (or, with `-p no:randomly`,
    the files')."""
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_group(item)))
    if hasattr(config, "workerinput"):  # an xdist worker: every worker sorts alike (a stable sort)
        items.sort(key=lambda item: _heavy_first(_group(item)))


#: What the app exports for the Neuron stack (neuron_app.environment): restored after every test, so a test that
#: resolved the neuron backend in-process leaks no value that later subprocesses would take for the user's.
NEURON_ENV = (
    "TORCH_NEURONX_NEFF_CACHE_DIR",
    "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION",
    "TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS",
    "NEURON_RT_VISIBLE_CORES",
    "_NEURON_APP_EXPORTED",
)


@pytest.fixture(scope="module", autouse=True)
def _emulated_machine_per_module() -> Iterator[None]:
    """A module's own fixtures (a manager, an app, a bench run's subprocesses) get an emulated machine of their own:
    the emulator, like the runtime, keeps a process's cores until it exits, and an xdist worker outlives its
    modules. test_real_size's in-process manager held cores 0-1 of the worker's machine, and the bench smoke run
    next in that worker could not take core 0 for its `postprocess` section (.ci/run, the files' order)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NEURON_EMULATOR_CORES_DIR", tempfile.mkdtemp(dir=_SESSION_TMP, prefix="neuron-cores-module-"))
        yield


@pytest.fixture(autouse=True)
def _neuron_env_per_test() -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in (*NEURON_ENV, "NEURON_EMULATOR_CORES_DIR")}
    os.environ["NEURON_EMULATOR_CORES_DIR"] = tempfile.mkdtemp(dir=_SESSION_TMP, prefix="neuron-cores-")
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session", autouse=True)
def _room_for_many_pipelines() -> None:
    """A server holds one pipeline; this test process builds dozens. Dynamo keys its cache on the
    transformer's code object, shared by every instance, so each instance's shapes add entries there and
    the limit the manager allows one pipeline (2 x shapes + 8) is reached. Raise the headroom here."""
    from neuron_app.engine.compile import compiler

    compiler.RECOMPILE_HEADROOM = 4096


@pytest.fixture(scope="session")
def shared_models() -> Path:
    """One tiny model build per session; each test's cache folder links to it."""
    from neuron_app.engine.model.tiny import ensure_tiny

    models = _SESSION_TMP / "models"
    ensure_tiny(models, "tiny")
    return models


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
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.settings import load_settings

    cache_dir = link_models(tmp_path_factory.mktemp("cache"), shared_models)
    manager = PipelineManager(load_settings(**(TINY_OVERRIDES | {"cache_dir": cache_dir})))
    manager.ensure_loaded()
    return manager


def launch_on_a_free_port(overrides: dict[str, Any]) -> Any:
    """The real app built from tiny settings plus `overrides` and launched without blocking on a free local port.
    The machine is shared: a port that another process took between `free_port` and the bind is given up for
    another one (Gradio's "Cannot find empty port"), a few times."""
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.settings import load_settings
    from neuron_app.web.server import build_app, launch

    for attempt in range(3):
        settings = load_settings(**(TINY_OVERRIDES | {"server_port": free_port()} | overrides))
        app = build_app(settings, PipelineManager(settings))
        try:
            launch(app, block=False)
        except OSError as exc:
            app.demo.close()
            if "Cannot find empty port" not in str(exc) or attempt == 2:
                raise
            continue
        app.url = f"http://127.0.0.1:{settings.server_port}/"
        return app
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def launched_app(tmp_path_factory: pytest.TempPathFactory, shared_models: Path) -> Iterator[Any]:
    """The real app (tiny model, aot_eager) launched without blocking on a free local port."""
    app = launch_on_a_free_port({"cache_dir": link_models(tmp_path_factory.mktemp("appcache"), shared_models)})
    yield app
    app.demo.close()


@pytest.fixture(scope="module")
def client(launched_app: Any) -> Any:
    from gradio_client import Client

    return Client(launched_app.url, verbose=False, httpx_kwargs=PATIENT_HTTP)


@pytest.fixture(scope="module")
def launch_tiny(tmp_path_factory: pytest.TempPathFactory, shared_models: Path) -> Iterator[Callable[..., Any]]:
    """Launch the real tiny app with settings overrides (queue size, auth, compile backend...) on a free
    local port; every app launched is closed after the module."""
    apps: list[Any] = []

    def launch_one(**overrides: Any) -> Any:
        cache_dir = link_models(tmp_path_factory.mktemp("appcache"), shared_models)
        app = launch_on_a_free_port({"cache_dir": cache_dir} | overrides)
        apps.append(app)
        return app

    yield launch_one
    for app in apps:
        app.demo.close()


@pytest.fixture
def run_app_py(tmp_path: Path, shared_models: Path) -> Iterator[Callable[..., AppProcess]]:
    """Start `python app.py` with tiny settings from NEURON_APP_* variables; keyword arguments add variables
    (`shutdown_grace_s=10` -> NEURON_APP_SHUTDOWN_GRACE_S=10), `env` other variables as they are.
    Killed at teardown if still running."""
    started: list[AppProcess] = []

    def start(env: dict[str, str] | None = None, **variables: Any) -> AppProcess:
        import json

        cache_dir = link_models(tmp_path / f"app{len(started)}", shared_models)
        settings = TINY_OVERRIDES | {"cache_dir": str(cache_dir), "server_port": free_port()} | variables
        environ = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_APP_")} | (env or {})
        for key, value in settings.items():
            environ[f"NEURON_APP_{key.upper()}"] = value if isinstance(value, str) else json.dumps(value)
        proc = AppProcess(cache_dir, environ, tmp_path / f"app{len(started)}.log")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
