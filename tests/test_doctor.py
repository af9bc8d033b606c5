"""`python -m neuron_app doctor` and `precompile --cores`, run as users run them (subprocesses)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from neuron_app.doctor import check_cache, check_instance
from neuron_app.doctor_stack import check_sdk_import, check_sdk_release, sdk_release
from tests.neuron_fakes import BROKEN_IMPORT, FAKE_SDK, XLA_VERSION, fake_sdk_dir
from tests.support import PROBE, ROOT, WATCHED


@functools.cache
def persistent() -> Path | None:
    """A cache folder the doctor itself calls persistent (it rightly calls /tmp, a tmpfs or a container layer a
    problem), wherever the checkout lives: the project's ignored .cache folder, else ~/.cache; None if neither."""
    for folder in (ROOT / ".cache" / "doctor-tests", Path.home() / ".cache" / "neuron-app-doctor-tests"):
        if check_cache(folder, "NEFF cache", "test").verdict == "ok":
            return folder
    return None


def doctor(*args: str, pythonpath: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in WATCHED and not k.startswith(("NEURON_APP_", "_NEURON"))}
    base |= {"NEURON_APP_CACHE_DIR": str(persistent() or ROOT / ".cache" / "doctor-tests")}
    # The tiny model: the plan check of klein-4B's seven default shapes takes 25 s a run on 2 cores (measured on
    # fake tensors); what the plan says of a real model is tested in-process below (test_the_plan_check...).
    base |= {"NEURON_APP_MODEL": "tiny"} | env
    if pythonpath is not None:
        base["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(
        [sys.executable, "-m", "neuron_app", "doctor", *args],
        cwd=ROOT,
        env=base,
        capture_output=True,
        text=True,
        timeout=120,
    )


def verdicts(result: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in json.loads(result.stdout)["checks"]}


def test_on_this_cpu_machine_it_says_neuron_is_unavailable_without_a_traceback() -> None:
    result = doctor(NEURON_APP_DEVICE="neuron")
    assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any(line.split()[:3] == ["torch-neuronx", "problem", "absent"] for line in lines)
    assert lines[-1].startswith("verdict: ") and "would not work" in lines[-1]
    assert "fix: device 'neuron' needs TorchNeuron" in result.stdout
    checks = verdicts(doctor("--json", NEURON_APP_DEVICE="neuron"))
    assert checks["neuron device"]["verdict"] == "problem"
    expected = {"python", "torch", "neuronx-cc", "nki", "neuron sdk", "fallback", "visible cores", "instance"}
    assert expected | {"NEFF cache"} <= set(checks)


def test_the_quick_start_on_this_cpu_machine_is_ok_with_the_trainium_checks_as_notes() -> None:
    """The quick start's settings (device auto, no TorchNeuron, not a Trainium instance) serve on the CPU: the
    doctor judges that device, exits 0, and keeps each failing Trainium check as a note with its fix."""
    result = doctor(NEURON_APP_SETTINGS="quickstart.toml", NEURON_APP_MODEL="tiny-shapes")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any(line.split()[:3] == ["torch-neuronx", "note", "absent"] for line in lines)
    assert "verdict: ok, serving on cpu or cuda (auto) should work here" in lines
    assert lines[-1].startswith("notes: ") and "NEURON_APP_DEVICE=neuron" in lines[-1]
    checks = verdicts(doctor("--json", NEURON_APP_SETTINGS="quickstart.toml", NEURON_APP_MODEL="tiny-shapes"))
    assert checks["neuron device"]["verdict"] == "note" and checks["device"]["verdict"] == "ok"
    assert not [c for c in checks.values() if c["verdict"] == "problem"]


def test_with_torchneuron_installed_the_stack_and_device_checks_pass() -> None:
    """FAKE TorchNeuron with two cores: every software and device check is ok; what is left is this
    machine (python 3.11 here, no neuronx-cc, not a trn instance), so it still exits 1."""
    checks = verdicts(doctor("--json", pythonpath=FAKE_SDK, FAKE_NEURON_CORES="2"))
    assert checks["torch-neuronx"]["verdict"] == "ok" and "TorchNeuron" in checks["torch-neuronx"]["found"]
    assert checks["torch"]["verdict"] == "ok"
    assert checks["neuron device"]["verdict"] == "ok" and "2 NeuronCore(s)" in checks["neuron device"]["found"]
    assert checks["fallback"]["verdict"] == "ok"
    assert checks["fallback"]["found"].startswith("execution-error fallback off (set by the app)")
    neff = checks["NEFF cache"]
    if persistent() is None:  # nowhere persistent on this machine: the doctor must say so
        assert neff["verdict"] == "problem", neff
    else:
        assert neff["verdict"] == "ok" and str(persistent() / "neff") in neff["found"], neff
    stack = verdicts(doctor("--json", "--stack", pythonpath=FAKE_SDK))
    assert "neuron device" not in stack and "instance" not in stack  # an image build has neither
    imported = stack["import torch_neuronx"]
    assert imported["verdict"] == "ok" and "torch.neuron present" in imported["found"]


def test_an_installed_wheel_that_does_not_load_fails_the_build_check(tmp_path: Path) -> None:
    """Package metadata says TorchNeuron 2.13 is installed, but importing it raises (a wheel built for another
    Ubuntu or Python): `doctor --stack`, the Dockerfile's build check, fails with that one line."""
    broken = fake_sdk_dir(tmp_path, on_import=BROKEN_IMPORT)
    result = doctor("--stack", pythonpath=broken)
    assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("import torch_neuronx"))
    assert line.split()[2] == "problem" and "ImportError: FAKE: libnrt.so.1: cannot open shared object" in line
    assert "Ubuntu 26.04" in result.stdout and "import torch_neuronx)" in result.stdout.splitlines()[-1]
    checks = verdicts(doctor("--json", "--stack", pythonpath=broken))
    assert checks["torch-neuronx"]["verdict"] == "ok"  # metadata alone would have passed it


def test_the_import_check_has_a_timeout_and_wants_the_neuron_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An import that hangs is a problem after the timeout; a torch_neuronx that registers no `neuron` device
    module (the PyTorch/XLA package's shape) is one too."""
    hangs = fake_sdk_dir(tmp_path, on_import="import time; time.sleep(60)")
    monkeypatch.setenv("PYTHONPATH", str(hangs))
    start = time.monotonic()
    check = check_sdk_import(timeout_s=2)
    assert check.verdict == "problem" and check.found == "did not finish in 2 s" and time.monotonic() - start < 30
    bare = tmp_path / "bare-site" / "torch_neuronx"
    bare.mkdir(parents=True)
    (bare / "__init__.py").write_text('"""FAKE: a torch_neuronx that registers no neuron device."""\n')
    monkeypatch.setenv("PYTHONPATH", str(bare.parent))
    check = check_sdk_import(timeout_s=120)
    assert check.verdict == "problem" and "has no 'neuron' device module" in check.found


def test_the_xla_package_a_silent_fallback_and_a_tmp_cache_are_problems(tmp_path: Path) -> None:
    result = doctor(
        "--json",
        pythonpath=fake_sdk_dir(tmp_path, XLA_VERSION),
        TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION="0",
        NEURON_APP_CACHE_DIR=str(tmp_path / "cache"),
    )
    checks = verdicts(result)
    assert result.returncode == 1
    assert checks["torch-neuronx"]["verdict"] == "problem" and "PyTorch/XLA" in checks["torch-neuronx"]["found"]
    assert {"torch-neuronx==2.13.*", "torch-neuronx==2.14.*"} <= set(checks["torch-neuronx"]["fix"].split())
    assert checks["neuron device"]["verdict"] == "problem" and "not checked" in checks["neuron device"]["found"]
    assert checks["fallback"]["verdict"] == "problem" and "DISABLE_FALLBACK_EXECUTION=0" in checks["fallback"]["found"]
    assert checks["NEFF cache"]["verdict"] == "problem" and "wiped on reboot" in checks["NEFF cache"]["fix"]


@pytest.mark.parametrize(
    ("product", "verdict", "fragment"),
    [
        ("trn2.48xlarge\n", "ok", ""),
        ("trn3.3xlarge", "ok", ""),
        ("trn1.32xlarge", "problem", "Trn2 and Trn3 only"),
        ("inf2.xlarge", "problem", "Trn2 and Trn3 only"),
        ("m7i.large", "problem", "launch a trn2 or trn3"),
        (None, "info", ""),
    ],
)
def test_instance_type_verdicts(tmp_path: Path, product: str | None, verdict: str, fragment: str) -> None:
    path = tmp_path / "product_name"
    if product is not None:
        path.write_text(product)
    check = check_instance(path)
    assert check.verdict == verdict and fragment in check.fix


@pytest.mark.parametrize(
    ("cc", "release"),
    [
        ("2.28.7631.0", "2.33"),
        ("2.29.100.0", "newer than 2.33 (2.34 or later)"),
        ("2.28.9000.0", "newer than 2.33 (2.34 or later)"),
        ("2.26.6360.0", "older than 2.33 (not TorchNeuron's)"),
        (None, "unknown"),
        ("0.1.dev0", "unknown"),
    ],
)
def test_the_compiler_version_names_its_release(cc: str | None, release: str) -> None:
    """2.34's compiler version is unconfirmed, so anything past 2.33's reads as "2.34 or later", never a guess."""
    assert sdk_release(cc) == release


@pytest.mark.parametrize(
    ("neuronx", "release"),
    [("2.13.3.1", "2.34"), ("2.14.3.1.412", "2.34"), ("2.13.3.0", "2.33"), ("2.13.3.2", None), ("0.1.0", None)],
)
def test_the_torchneuron_build_names_its_release(neuronx: str, release: str | None) -> None:
    from neuron_app.doctor_stack import torchneuron_release

    assert torchneuron_release(neuronx) == release


def test_the_doctor_says_which_sdk_release_it_found(tmp_path: Path) -> None:
    """T7: with the FAKE TorchNeuron of the 2.34 build (tests/fake_neuron_sdk), the doctor names Neuron SDK 2.34;
    with a 2.33 build, 2.33."""
    for version, release in (("2.13.3.1", "Neuron SDK 2.34 (torch-neuronx 2.13.3.1)"), ("2.13.3.0", "SDK 2.33")):
        checks = verdicts(doctor("--json", pythonpath=fake_sdk_dir(tmp_path, version)))
        assert release in checks["neuron sdk"]["found"], checks["neuron sdk"]


def test_the_sdk_check_shows_what_the_install_script_recorded(tmp_path: Path) -> None:
    record = tmp_path / "neuron-sdk.txt"
    assert "not installed by scripts/install-neuron.sh" in check_sdk_release(record).found
    record.write_text("Neuron SDK 2.34 on Ubuntu 24.04 (requirements-neuron.txt)\naws-neuronx-runtime-lib==9\n")
    check = check_sdk_release(record)
    assert check.verdict == "info" and "Neuron SDK 2.34 on Ubuntu 24.04" in check.found
    assert "runtime-lib" not in check.found  # the first line only


def test_precompile_cores_reserves_them_before_torch_loads_and_bad_ranges_are_refused(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in WATCHED and not k.startswith("NEURON_APP_")}
    env |= {"NEURON_APP_MODEL": "tiny", "NEURON_APP_CACHE_DIR": str(tmp_path / "cache")}
    argv = ["-m", "neuron_app", "precompile", "--cores", "4-7"]
    out = subprocess.run(
        [sys.executable, "-c", PROBE % {"watched": WATCHED, "argv": argv}],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    seen = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("PROBE "))[6:])
    assert seen["NEURON_RT_VISIBLE_CORES"] == "4-7", out.stderr[-2000:]
    bad = subprocess.run(
        [sys.executable, "-m", "neuron_app", "precompile", "--cores", "7-4"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "visible_cores" in bad.stderr and "Traceback" not in bad.stderr


def test_the_doctor_says_before_any_compile_whether_the_served_model_fits_and_its_floor(monkeypatch: Any) -> None:
    """The topology the app would serve (issues 43, 56): klein-4B at 1024x1024 on a trn2.3xlarge's 4 cores is 4
    copies of TP 1 (together, 14.9 of 24 GiB each), a floor under a second per image; a model the plan does not know
    is said to be so."""
    from neuron_app.doctor import check_plan
    from neuron_app.settings import load_settings

    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES", raising=False)
    real = load_settings(model="black-forest-labs/FLUX.2-klein-4B", resolutions=["1024x1024"])
    check = check_plan(real)
    assert check.verdict == "ok" and "1 copy of TP 1 (together) on cores [0]" in check.found, check
    assert "s per image" in check.found and "floor 0." not in check.found
    tiny = check_plan(load_settings(model="tiny", device="cpu"))
    assert tiny.verdict == "info" and "not a model the plan knows" in tiny.found


def test_the_doctor_says_problem_when_the_placement_needs_more_cores_than_held(monkeypatch: Any) -> None:
    """The fifth review's U1 and the seventh's V4: klein-9B with everything on one trn2 core is 27.9 GiB of weights,
    so the plan places the text encoder apart, on a second core; with one core held (NEURON_RT_VISIBLE_CORES=0)
    that is a problem naming the cores it needs; with two it is ok."""
    from neuron_app.doctor import check_plan
    from neuron_app.settings import load_settings

    nine = {"model": "black-forest-labs/FLUX.2-klein-9B", "resolutions": ["1024x1024"]}
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0")
    one = check_plan(load_settings(**nine))
    assert one.verdict == "problem" and "of TP 1 (text-encoder-apart) needs 2 NeuronCores" in one.found, one
    assert "this host holds 1 (cores 0-0)" in one.found and "NEURON_APP_VISIBLE_CORES=0-1" in one.found
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
    two = check_plan(load_settings(**nine))
    assert two.verdict == "ok" and "1 copy of TP 1 (text-encoder-apart) on cores [0, 1]" in two.found, two
    together = check_plan(load_settings(**nine, placement="together"))
    assert together.verdict == "problem" and "nothing fits" in together.found, together
