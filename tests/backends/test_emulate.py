"""`python -m neuron_app emulate`: the diffusers guide's own snippets (examples/) and a user's pytest suite run
on the emulated neuron device in a subprocess, as a user runs them, with the tiny model for the Hub id."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT


def emulate(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NEURON_APP_", "TORCH_NEURONX_"))}
    base |= {"PYTHONPATH": str(ROOT), "TORCH_NEURONX_NEFF_CACHE_DIR": str(tmp_path / "neff")} | env
    return subprocess.run(
        [sys.executable, "-m", "neuron_app", "emulate", *args],
        cwd=tmp_path,
        env=base,
        capture_output=True,
        text=True,
        timeout=900,
    )


def tiny_folder(shared_models: Path) -> str:
    return str(next(p for p in shared_models.iterdir() if (p / "model_index.json").is_file()))


@pytest.mark.slow
def test_the_guides_eager_and_compiled_snippets_make_an_image_and_print_their_counts(
    tmp_path: Path, shared_models: Path
) -> None:
    from PIL import Image

    model = tiny_folder(shared_models)
    eager = emulate(
        [str(ROOT / "examples" / "guide_eager.py")], tmp_path, GUIDE_MODEL=model, GUIDE_SIZE="64", GUIDE_OUTPUT="e.png"
    )
    assert eager.returncode == 0, eager.stderr[-3000:]
    assert Image.open(tmp_path / "e.png").size == (64, 64)
    summary = eager.stderr[eager.stderr.index("neuron-emulated summary") :]
    assert "violations 0" in summary and "aten::scatter_.src" in summary, summary
    assert "graphs compiled 0" in summary and "eager compiles 0 " not in summary  # eager mode: ops compiled
    compiled = emulate(
        [str(ROOT / "examples" / "guide_compiled.py")],
        tmp_path,
        GUIDE_MODEL=model,
        GUIDE_SIZE="64",
        GUIDE_OUTPUT="c.png",
    )
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    assert Image.open(tmp_path / "c.png").size == (64, 64)
    summary = compiled.stderr[compiled.stderr.index("neuron-emulated summary") :]
    assert "graphs compiled 1" in summary and "violations 0" in summary, summary
    assert "NKI attention no (L=" in summary  # 16 image + 512 text tokens: 528
    assert "'persistent_hits': 0," not in summary  # the eager run's NEFF-style artifacts served the same ops


@pytest.mark.slow
def test_a_users_pytest_suite_runs_under_emulate_and_a_broken_rule_fails_the_script(tmp_path: Path) -> None:
    (tmp_path / "test_user.py").write_text(
        "import torch\n\n\n"
        "def test_neuron_is_there():\n"
        "    assert torch.neuron.is_available() and torch.neuron.device_count() == 1\n"
        "    layer = torch.nn.Linear(2, 2).to('neuron')\n"
        "    assert layer.weight.device.type == 'neuron'\n"
        "    out = layer(torch.ones(1, 2).to('neuron'))\n"
        "    assert out.device.type == 'neuron' and out.cpu().device.type == 'cpu'\n"
        "    torch.neuron.synchronize()\n"
    )
    suite = emulate(["-m", "pytest", "-q", "-p", "no:cacheprovider", "test_user.py"], tmp_path)
    assert suite.returncode == 0 and "1 passed" in suite.stdout, suite.stdout + suite.stderr[-2000:]
    (tmp_path / "broken.py").write_text("import torch\n\ntorch.randn(3, device='neuron')\n")
    broken = emulate(["broken.py"], tmp_path)
    assert broken.returncode == 1 and "neuron rule: torch.randn(device='neuron')" in broken.stderr
    assert "violations 1" in broken.stderr  # the summary still prints


@pytest.mark.slow
def test_under_torchrun_the_neuron_process_group_and_device_mesh_work(tmp_path: Path) -> None:
    """The guide's tensor-parallel set-up lines: `init_process_group(backend="neuron")` (gloo underneath) and
    `DeviceMesh("neuron", ...)` on two ranks. (diffusers' TensorParallelConfig sharding is not emulated yet.)"""
    (tmp_path / "mesh.py").write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch.distributed.device_mesh import DeviceMesh\n\n"
        'dist.init_process_group(backend="neuron")\n'
        'mesh = DeviceMesh("neuron", list(range(dist.get_world_size())))\n'
        "device = torch.neuron.current_device()\n"
        "total = torch.ones(1) * (dist.get_rank() + 1)\n"
        "dist.all_reduce(total)\n"
        'print("RANK", dist.get_rank(), mesh.device_type, mesh.size(), device, int(total.item()), flush=True)\n'
        "dist.barrier()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEURON_APP_", "TORCH_NEURONX_"))}
    env |= {"PYTHONPATH": str(ROOT), "TORCH_NEURONX_NEFF_CACHE_DIR": str(tmp_path / "neff")}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "neuron_app", "emulate", "mesh.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    ranks = sorted(line for line in done.stdout.splitlines() if line.startswith("RANK"))
    assert done.returncode == 0 and ranks == ["RANK 0 neuron 2 0 3", "RANK 1 neuron 2 0 3"], done.stderr[-3000:]
