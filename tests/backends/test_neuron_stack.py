"""The Neuron stack rules, with the FAKE SDK (the real one cannot be installed here): TorchNeuron
told from the XLA package, fallbacks off unless the user says otherwise, the user's cache folder
kept, core reservation, cache counters, the fingerprint, and the warm-up's step count and sync."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from neuron_app import environment
from neuron_app.backends import resolve_backend
from neuron_app.backends.neuron import NeuronCacheProbe
from neuron_app.backends.neuron_sdk import sdk_kind
from neuron_app.errors import DeviceUnavailable, SettingsError
from tests.neuron_fakes import FAKE_SDK, XLA_VERSION, fake_sdk_dir, fake_sdk_on_path
from tests.support import FALLBACKS, PROBE, ROOT, TINY_OVERRIDES, WATCHED, free_port, link_models


@pytest.fixture(autouse=True)
def _restore_environ() -> Iterator[None]:
    """`prepare_process` writes os.environ like the app does; give the next test the old one back."""
    saved = dict(os.environ)
    for name in [*WATCHED, environment.MARK_VAR, "WORLD_SIZE"]:
        os.environ.pop(name, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize(
    ("found", "kind"),
    [
        ("2.13.3.0", "torchneuron"),
        ("2.13.3.0.412", "torchneuron"),
        ("2.14.3.0", "torchneuron"),
        (XLA_VERSION, "xla"),
        ("2.1.2.2.4.0", "xla"),
        ("1.13.1.1.14.0", "xla"),
        ("1.0", "xla"),  # the empty PyPI placeholder
        (None, "absent"),
    ],
)
def test_version_family_tells_torchneuron_from_the_xla_package(found: str | None, kind: str) -> None:
    assert sdk_kind(found) == kind


def test_a_source_build_is_told_from_the_xla_package_by_its_dynamo_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TorchNeuron source build may carry its tree's version, 0.1.0: accepted when TorchNeuron's
    `neuron_dynamo_backend` is there (found without importing the package), refused as XLA when it is not."""
    with fake_sdk_on_path(monkeypatch, fake_sdk_dir(tmp_path, "0.1.0", dynamo_backend=True)):
        assert sdk_kind("0.1.0") == "torchneuron"
        backend = resolve_backend("neuron", tmp_path / "cache")
        assert backend.name == "neuron"
    with fake_sdk_on_path(monkeypatch, fake_sdk_dir(tmp_path, "0.1.0")):
        assert sdk_kind("0.1.0") == "xla"
        with pytest.raises(DeviceUnavailable, match=r"0\.1\.0 is the PyTorch/XLA package"):
            resolve_backend("neuron", tmp_path / "cache")
        assert "torch_neuronx" not in sys.modules


def test_the_doctor_does_not_match_a_source_builds_version_against_torch() -> None:
    from neuron_app.doctor_stack import check_torch

    assert check_torch("0.1.0").verdict == "ok" and "source build" in check_torch("0.1.0").found
    assert check_torch("2.13.3.0").verdict == "ok"  # torch 2.13.0 here
    wrong = check_torch("2.14.3.0")
    assert wrong.verdict == "problem" and "torch==2.14.0 with torch-neuronx==2.14.*" in wrong.fix


@pytest.mark.parametrize("device", ["neuron", "auto"])
def test_xla_torch_neuronx_is_refused_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """`import torch_neuronx` works with the XLA package too: refused in one line naming the fix, before
    the package is imported, and `auto` does not fall back to the CPU silently either."""
    with fake_sdk_on_path(monkeypatch, fake_sdk_dir(tmp_path, XLA_VERSION)):
        with pytest.raises(DeviceUnavailable) as info:
            resolve_backend(device, tmp_path / "cache")
        assert "torch_neuronx" not in sys.modules
    message = str(info.value)
    assert "\n" not in message and XLA_VERSION in message and "PyTorch/XLA" in message
    assert "torch-neuronx==2.13.*" in message and "torch==2.13.0" in message
    assert "torch-neuronx==2.14.*" in message and "torch==2.14.0" in message


def test_torchneuron_needs_a_neuron_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_NEURON_CORES", "0")
    with fake_sdk_on_path(monkeypatch, FAKE_SDK):
        with pytest.raises(DeviceUnavailable, match=r"no usable 'neuron' device.*doctor"):
            resolve_backend("neuron", tmp_path / "cache")
        # torchrun ranks check the device only after init_process_group
        backend = resolve_backend("neuron", tmp_path / "cache", check_device=False)
        assert backend.name == "neuron"


def test_fallbacks_are_turned_off_and_the_status_says_so(make_settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from neuron_app.engine.manager import PipelineManager

    settings = make_settings(device="neuron", compile_backend=None)
    values = {v.name: v for v in environment.prepare_process(settings)}
    assert all(values[name].value == "1" and values[name].origin == "app" for name in FALLBACKS)
    with fake_sdk_on_path(monkeypatch, FAKE_SDK):
        manager = PipelineManager(settings)
        import torch_neuronx  # the fake: what TorchNeuron reads when torch loads it

        assert all(torch_neuronx.FALLBACK_AT_IMPORT[name] == "1" for name in FALLBACKS)
        off = "execution-error fallback off (set by the app); no op has fallen back to the CPU so far"
        assert manager.status().fallback.startswith(off)
        assert manager.status().to_dict()["fallback"].startswith(off)


def test_a_users_fallback_setting_is_kept_and_shown(make_settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FALLBACKS[0], "0")
    values = {v.name: v for v in environment.prepare_process(make_settings(device="neuron"))}
    assert values[FALLBACKS[0]].value == "0" and values[FALLBACKS[0]].origin == "user"
    assert values[FALLBACKS[1]].origin == "app"
    assert os.environ[FALLBACKS[0]] == "0"
    state = environment.fallback_state()
    assert state.startswith("ON") and f"{FALLBACKS[0]}=0" in state


def test_a_users_neff_cache_folder_is_respected(
    tmp_path: Path, make_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = tmp_path / "my-neffs"
    monkeypatch.setenv(environment.NEFF_CACHE_VAR, str(mine))
    settings = make_settings(device="neuron", compile_backend=None)
    values = {v.name: v for v in environment.prepare_process(settings)}
    assert values[environment.NEFF_CACHE_VAR].origin == "user"
    with fake_sdk_on_path(monkeypatch, FAKE_SDK):
        backend = resolve_backend("neuron", settings.cache_dir)
        import torch_neuronx

        assert str(mine) == torch_neuronx.NEFF_CACHE_AT_IMPORT
        assert backend.compiled_artifacts_dirs(settings.cache_dir)[0] == mine
        assert backend.cache_probe("neuron", settings.cache_dir).folder_probe.folder == mine
    assert os.environ[environment.NEFF_CACHE_VAR] == str(mine)


def test_the_apps_own_export_is_not_mistaken_for_the_users(tmp_path: Path, make_settings: Any) -> None:
    """A second process (or call) with another cache folder re-exports; the marker tells app from user."""
    environment.prepare_process(make_settings(cache_dir=tmp_path / "a"))
    assert environment.origin(environment.NEFF_CACHE_VAR) == "app"
    environment.prepare_process(make_settings(cache_dir=tmp_path / "b"))
    assert os.environ[environment.NEFF_CACHE_VAR] == str(environment.neff_cache_dir(tmp_path / "b"))


def test_core_reservation(make_settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    environment.prepare_process(make_settings(visible_cores="4-7"))
    assert os.environ["NEURON_RT_VISIBLE_CORES"] == "4-7"
    assert make_settings(visible_cores=" 2 ").visible_cores == "2"
    for bad in ("4-", "7-4", "a"):
        with pytest.raises(SettingsError, match="visible_cores"):
            make_settings(visible_cores=bad)
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-3")
    os.environ.pop(environment.MARK_VAR)  # now it is the user's
    with pytest.raises(SettingsError, match="NEURON_RT_VISIBLE_CORES=0-3 is already set"):
        environment.prepare_process(make_settings(visible_cores="4-7"))
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SettingsError, match=r"visible_cores=4-7 reached a torchrun rank: a rank holds exactly one"):
        environment.prepare_process(make_settings(visible_cores="4-7"))
    environment.prepare_process(make_settings(visible_cores="5"))  # a rank's own core of its block (rank_env)
    assert os.environ["NEURON_RT_VISIBLE_CORES"] == "5"


@pytest.mark.parametrize(
    ("text", "cores"),
    [("3", (3, 3)), ("4-7", (4, 7)), ("3,4,5,6", (3, 6)), ("3-5,6", (3, 6)), (" 6, 3-5 ", (3, 6)), ("0-0", (0, 0))],
)
def test_the_runtimes_core_grammar_is_accepted(text: str, cores: tuple[int, int]) -> None:
    """NEURON_RT_VISIBLE_CORES as the runtime reads it: an index, a range, or a comma list (Ray writes lists)."""
    assert environment.parse_cores(text) == cores


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("0,2", "not contiguous (core(s) 1 missing)"),
        ("0-1,4-5", "core(s) 2, 3 missing"),
        ("3-5,5", "core(s) 5 more than once"),
        ("7-4", "ends before it starts"),
        ("4-", "not a NeuronCore index, range or list"),
        ("", "not a NeuronCore index"),
        ("1,,2", "not a NeuronCore index"),
    ],
)
def test_core_lists_the_runtime_would_refuse_are_refused(text: str, why: str, make_settings: Any) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        environment.parse_cores(text)
    with pytest.raises(SettingsError, match="visible_cores"):
        make_settings(visible_cores=text)


def test_a_core_list_is_one_reservation_in_any_spelling(make_settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The setting takes the list form and exports one range; the user's own list of the same cores agrees."""
    assert make_settings(visible_cores="3,4,5,6").visible_cores == "3-6"
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "3-5,6")  # the user's (no app marker)
    values = {v.name: v for v in environment.prepare_process(make_settings(visible_cores="3-6"))}
    assert values["NEURON_RT_VISIBLE_CORES"].value == "3-6"


def test_any_core_reservation_in_the_environment_is_refused_under_torchrun(
    make_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank holds exactly one NeuronCore (TorchNeuron asserts it): a range reaching a rank is refused before any
    rank loads; one core, the rank's own that the topology exports (scale/topology.py rank_env), is kept."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    settings = make_settings()
    environment.prepare_process(settings)  # nothing reserved: each rank gets core LOCAL_RANK
    for value in ("0-1", "2,3"):
        monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", value)
        with pytest.raises(SettingsError, match=rf"NEURON_RT_VISIBLE_CORES={value} cannot be used under torchrun"):
            environment.prepare_process(settings)
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "3")
    values = {v.name: v for v in environment.prepare_process(settings)}
    assert values["NEURON_RT_VISIBLE_CORES"].value == "3"


@pytest.mark.parametrize(
    ("value", "verdict", "found"),
    [("3,4,5,6", "ok", "4 core(s) reserved"), ("3-5,6", "ok", "4 core(s)"), ("0,2", "problem", "0,2")],
)
def test_the_doctor_reads_the_runtimes_core_grammar(
    value: str, verdict: str, found: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from neuron_app.doctor import check_cores

    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", value)
    check = check_cores(None)
    assert check.verdict == verdict and found in check.found
    if verdict == "problem":
        assert "contiguous" in check.fix


def test_a_replica_exports_the_neuron_environment_itself(make_settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica on a joined Ray cluster inherits nothing from the front end: its `_load` runs prepare_process
    first (switches and NEFF folder exported before torch), keeps the cores Ray gave it, and the front end
    forwards its own values in `runtime_env` (never the cores)."""
    from neuron_app.scale.replica_server import prepare_replica_environment

    settings = make_settings(device="neuron", compile_backend=None, visible_cores="0-3")
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "5")  # Ray's choice for this replica
    prepare_replica_environment(settings)
    assert {name: os.environ[name] for name in FALLBACKS} == environment.FALLBACK_VARS
    assert os.environ[environment.NEFF_CACHE_VAR] == str(environment.neff_cache_dir(settings.cache_dir))
    assert os.environ["NEURON_RT_VISIBLE_CORES"] == "5"
    forwarded = environment.forwarded_env()
    assert set(forwarded) == {environment.NEFF_CACHE_VAR, *FALLBACKS, environment.MARK_VAR}
    assert "NEURON_RT_VISIBLE_CORES" not in json.loads(forwarded[environment.MARK_VAR])
    # What a replica on another node receives reads as the app's own values there, not as the user's.
    for name in WATCHED:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(environment.MARK_VAR)
    for name, value in forwarded.items():
        monkeypatch.setenv(name, value)
    assert {environment.origin(name) for name in [environment.NEFF_CACHE_VAR, *FALLBACKS]} == {"app"}


def test_the_replicas_load_runs_prepare_process_before_the_manager(make_settings: Any) -> None:
    """The real `_load` of a replica (the tiny model on the CPU, no Ray): the NEFF folder is exported by it."""
    from neuron_app.scale.replica_server import ReplicaServer

    settings = make_settings()
    assert environment.NEFF_CACHE_VAR not in os.environ
    manager = ReplicaServer.__new__(ReplicaServer)._load(settings)  # the method alone: no Ray actor around it
    folder = environment.neff_cache_dir(settings.cache_dir)
    assert manager.loaded and os.environ[environment.NEFF_CACHE_VAR] == str(folder)


def test_cache_evidence_uses_torchneurons_counters_when_present(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new NEFF from another process would fake a miss in the folder; the counters are this process's."""
    probe = NeuronCacheProbe(tmp_path)
    with fake_sdk_on_path(monkeypatch, FAKE_SDK):
        from torch_neuronx import _C

        monkeypatch.setitem(_C.STATS, "persistent_hits", 0)
        monkeypatch.setitem(_C.STATS, "persistent_misses", 0)
        before = probe.snapshot()
        _C.STATS["persistent_hits"] += 3
        (tmp_path / "ab").mkdir()
        (tmp_path / "ab" / "other-process.neff").write_bytes(b"x")
        assert before[0] == "counters" and probe.judge(before, probe.snapshot()) == "disk"
        before = probe.snapshot()
        _C.STATS["persistent_misses"] += 1
        assert probe.judge(before, probe.snapshot()) == "miss"
        monkeypatch.delattr(_C, "_get_compilation_cache_stats")
        assert probe.snapshot()[0] == "folder"  # the private API gone: the folder probe


def test_fingerprint_has_compiler_flags_logical_cores_and_nki(
    make_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from neuron_app.engine.manager import PipelineManager

    settings = make_settings(device="neuron", compile_backend=None)
    with fake_sdk_on_path(monkeypatch, FAKE_SDK):
        plain = PipelineManager(settings)
        monkeypatch.setenv("NEURON_CC_FLAGS", "--optlevel 3")
        flagged = PipelineManager(settings)
        monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
        lnc = PipelineManager(settings)
    assert {"torch-neuronx", "neuronx-cc", "nki", "NEURON_CC_FLAGS", "NEURON_LOGICAL_NC_CONFIG"} <= set(
        plain.fingerprint_fields
    )
    assert plain.fingerprint_fields["torch-neuronx"] == "2.13.3.1"
    assert len({plain.fingerprint, flagged.fingerprint, lnc.fingerprint}) == 3


def test_warmup_runs_the_serving_step_count_and_waits_for_the_device(
    make_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counted by the real tiny pipeline's scheduler: the warm-up compile ran `default_steps` steps; a
    device error that surfaces only at the sync marks the shape failed with its message."""
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.errors import CompileFailed

    manager = PipelineManager(make_settings(default_steps=3))

    def broken_sync() -> None:
        raise RuntimeError("neuronx-cc failed: NCC_EVRF009 instruction count exceeds limit")

    monkeypatch.setattr(manager.backend, "synchronize", broken_sync)
    with pytest.raises(CompileFailed, match="NCC_EVRF009"):
        manager.compile_shape("64x64")
    shape = manager.status().shapes["64x64"]
    assert shape.state == "failed" and "NCC_EVRF009" in shape.last_error

    syncs: list[int] = []
    monkeypatch.setattr(manager.backend, "synchronize", lambda: syncs.append(1))
    manager.compile_shape("64x64")  # a retry: ready now
    scheduler = manager.pipe.scheduler
    assert len(scheduler.timesteps) == 3 and scheduler.step_index == 3
    assert syncs == [1] and manager.status().shapes["64x64"].state == "ready"


# --- every entry exports the environment before torch is imported -----------------------------------------------
def _bench_spec(cache_dir: Path) -> str:
    settings = TINY_OVERRIDES | {"cache_dir": str(cache_dir), "device": "auto"}
    return json.dumps({"kind": "measure", "settings": settings, "steps": 1, "repeats": 1, "shapes": ["64x64"]})


ENTRIES = {
    "app.py": lambda cache: ["app.py"],
    "torchrun app.py (rank 1)": lambda cache: ["app.py"],
    "python -m neuron_app precompile": lambda cache: ["-m", "neuron_app", "precompile"],
    "python -m neuron_app doctor": lambda cache: ["-m", "neuron_app", "doctor"],
    "python -m neuron_app.bench worker": lambda cache: ["-m", "neuron_app.bench", "_worker", _bench_spec(cache)],
}


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_every_entry_exports_the_environment_before_torch_is_imported(
    entry: str, tmp_path: Path, shared_models: Path
) -> None:
    """At the moment `import torch` first runs (when TorchNeuron autoloads and reads it), the NEFF
    folder and both fallback switches are already in the environment."""
    cache = link_models(tmp_path / "cache", shared_models)
    env = {k: v for k, v in os.environ.items() if k not in WATCHED and not k.startswith("NEURON_APP_")}
    env |= {"NEURON_APP_MODEL": "tiny", "NEURON_APP_DEVICE": "auto", "NEURON_APP_CACHE_DIR": str(cache)}
    env |= {
        "NEURON_APP_RESOLUTIONS": json.dumps(TINY_OVERRIDES["resolutions"]),
        "NEURON_APP_DEFAULT_RESOLUTION": "64x64",
    }
    env |= {"NEURON_APP_LOAD_ON_START": "true", "NEURON_APP_WARMUP": "all"}
    env["NEURON_APP_SERVER_PORT"] = str(free_port())  # app.py binds before torch loads: 7860 may be taken
    if entry.endswith("doctor"):  # it imports torch only where a TorchNeuron is installed: the FAKE one
        env["PYTHONPATH"] = str(FAKE_SDK)
    if entry.startswith("torchrun"):
        env |= {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    code = PROBE % {"watched": WATCHED, "argv": ENTRIES[entry](cache)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stdout.splitlines() if line.startswith("PROBE ")]
    assert lines, f"torch was never imported?\n{out.stdout}\n{out.stderr[-2000:]}"
    seen = json.loads(lines[0][len("PROBE ") :])
    assert Path(seen[environment.NEFF_CACHE_VAR]).parent == cache / "neff"  # keyed by the SDK it sees (T12)
    assert all(seen[name] == "1" for name in FALLBACKS), seen


def test_the_neff_folder_is_keyed_by_the_chip_it_compiles_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """U10: a cache folder shared by a trn2 and a trn3 fleet never mixes their NEFFs: the folder's name carries the
    platform target (the Neuron stack's NEURON_PLATFORM_TARGET_OVERRIDE, else the instance family from the DMI
    product name), read without torch before the folder is named."""
    monkeypatch.delenv(environment.NEFF_CACHE_VAR, raising=False)
    products = {"trn2.48xlarge": "trn2", "trn2u.48xlarge": "trn2", "trn3.48xlarge": "trn3", "m7i.large": "unknown"}
    for product, family in products.items():
        (tmp_path / "product_name").write_text(product + "\n")
        assert environment.platform_target(tmp_path / "product_name") == family, product
    assert environment.platform_target(tmp_path / "absent") == "unknown"
    folders = {}
    for target in ("trn2", "trn3"):
        monkeypatch.setenv(environment.PLATFORM_TARGET_VAR, target)
        folders[target] = environment.neff_cache_dir(tmp_path / "cache")
        assert folders[target].parent == tmp_path / "cache" / "neff"
        assert f"-{target}-" in folders[target].name, folders[target].name
    assert folders["trn2"] != folders["trn3"]
