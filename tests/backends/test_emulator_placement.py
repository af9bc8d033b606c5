"""Placement by storage and HBM by storage (the fourth review's T4-T6, issue 43's HBM per core): a tensor made on
the host is on the host, `.cpu()` / `Module.to("cpu")` / a new Parameter over device memory say where the memory
is, no weak reference is put on a tensor, every thread is under the rules, and device memory (weights and live
activations) is counted until its storage dies, with an out-of-memory failure past one core's HBM."""

from __future__ import annotations

import subprocess
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest

from neuron_app.errors import NeuronRuleViolation

SAME_DEVICE = "Expected all tensors to be on the same device"


@pytest.fixture
def emulator(tmp_path: Path) -> Any:
    from neuron_app.backends.emulator.cache import forget_memory
    from neuron_app.backends.emulator.rules import NeuronEmulator

    forget_memory()
    return NeuronEmulator(tmp_path / "neff-emulated")


def test_a_tensor_made_on_the_host_meets_a_device_tensor_with_the_devices_error(emulator: Any) -> None:
    import torch

    with emulator.device_work():
        dev = torch.ones(4, 4, device="neuron")
        with pytest.raises(NeuronRuleViolation, match=SAME_DEVICE + r".*neuron:0 and cpu"):
            _ = dev + torch.ones(4, 4)  # no device=: host memory (T4)
        layer = torch.nn.Linear(4, 4)
        emulator.adopt(layer)
        with pytest.raises(NeuronRuleViolation, match=SAME_DEVICE + r".*aten\.addmm"):
            layer(torch.ones(1, 4))
        assert emulator.is_device(layer(dev)) and (dev + torch.tensor(2.0)).device.type == "neuron"  # 0-dim: ok


def test_placement_follows_the_storage_not_the_python_object(emulator: Any) -> None:
    import torch

    with emulator.device_work():
        layer = torch.nn.Linear(4, 4)
        emulator.adopt(layer)
        weight = layer.weight
        assert weight.device.type == "neuron" and weight.data.device.type == "neuron" and weight[0].is_cpu is False
        param = torch.nn.Parameter(weight.detach())  # a new object over device memory (accelerate does this)
        assert param.device.type == "neuron" and param.to("neuron") is param  # as torch returns self
        host = weight.cpu()
        assert host.device.type == "cpu" and emulator.is_host(host) and emulator.is_device(weight)
        layer.to("cpu")  # swaps param.data for a host copy: the same Parameter object is now on the host
        assert layer.weight is weight and weight.device.type == "cpu"
        assert emulator.weight_bytes == 64  # the old weight's storage: `param` still holds it (16 floats)
        del param
        assert emulator.weight_bytes == 0
        assert layer(torch.ones(1, 4)).device.type == "cpu"
        assert weakref.getweakrefcount(weight) == 0  # no weak reference on a tensor: swap_tensors works
        other = torch.nn.Linear(4, 4)
        torch.utils.swap_tensors(weight, other.weight)
        dev = torch.ones(2, device="neuron")
        assert dev.to("meta").device.type == "meta"  # accelerate's sequential offload: torch's own move


def test_every_thread_is_under_the_rules_and_its_memory_counts(emulator: Any) -> None:
    import torch

    errors: list[BaseException] = []
    made: list[Any] = []

    def worker() -> None:
        with emulator.device_work():
            made.append(torch.ones(256, device="neuron"))
            try:
                _ = made[0] + torch.ones(256)
            except NeuronRuleViolation as exc:
                errors.append(exc)

    before = emulator.hbm_bytes_in_use()
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert len(errors) == 1 and SAME_DEVICE in str(errors[0])
    assert emulator.hbm_bytes_in_use() == before + 1024  # made there, held here: device memory by storage
    made.clear()
    errors.clear()  # its traceback's frames held the tensor too
    assert emulator.hbm_bytes_in_use() == before


def test_hbm_counts_weights_and_live_activations_by_storage_with_a_peak(tmp_path: Path) -> None:
    import torch

    from neuron_app.backends.emulator.rules import NeuronEmulator

    em = NeuronEmulator(tmp_path / "neff", hbm_gib=64 * 1024 / 2**30)  # 64 KiB of HBM
    layer = torch.nn.Linear(64, 64, bias=False)  # 16 KiB of weights
    em.adopt(layer)
    assert em.hbm_bytes_in_use() == em.weight_bytes == 16384
    with em.device_work():
        x = torch.ones(64, 64, device="neuron")  # 16 KiB
        y = layer(x)  # 16 KiB more
        view = y[:32]  # a view: no new memory
        assert em.hbm_bytes_in_use() == 3 * 16384 and em.hbm_peak_bytes() == 3 * 16384
        del y
        assert em.hbm_bytes_in_use() == 3 * 16384  # the view keeps y's storage alive
        del view
        assert em.hbm_bytes_in_use() == 2 * 16384
        z = [torch.zeros(64, 64, device="neuron") for _ in range(2)]  # 32 KiB more: 64 KiB, the whole core
        with pytest.raises(NeuronRuleViolation, match=r"Failed to allocate 16384 bytes on DEVICE .* in use 65536 "):
            layer(z[0])  # one activation past the capacity: the runtime's out-of-memory
        assert em.hbm_peak_bytes() == 65536 and em.snapshot()["hbm_peak_gib"] == round(65536 / 2**30, 3)
        del z, x
    assert em.hbm_bytes_in_use() == 16384


def test_hbm_per_core_follows_the_instance_and_its_lnc() -> None:
    from neuron_app.backends.emulator.cores import hbm_per_core_gib

    assert hbm_per_core_gib({}) == 24.0  # trn2.3xlarge at LNC=2: 96 GiB over 4 logical cores, a bank each
    assert hbm_per_core_gib({"NEURON_LOGICAL_NC_CONFIG": "1"}) == 24.0  # 8 cores, two to a 24 GiB bank (U6)
    assert hbm_per_core_gib({"NEURON_EMULATOR_INSTANCE": "trn2.48xlarge"}) == 24.0  # 16 chips, the same per core
    assert hbm_per_core_gib({"NEURON_EMULATOR_HBM_GIB": "2", "NEURON_LOGICAL_NC_CONFIG": "1"}) == 2.0


def test_the_emulated_sdk_never_shadows_a_real_torch_neuronx(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from neuron_app.backends.emulator import sdk

    real = types.ModuleType("torch_neuronx")  # stands for an installed SDK (a trn instance)
    monkeypatch.setitem(sys.modules, "torch_neuronx", real)
    assert sdk.install(object()) is None and sys.modules["torch_neuronx"] is real


def emulate(tmp_path: Path, code: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(code)
    env_cache = {"TORCH_NEURONX_NEFF_CACHE_DIR": str(tmp_path / "neff")}
    import os

    return subprocess.run(
        [sys.executable, "-m", "neuron_app", "emulate", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env_cache},
        cwd=Path(__file__).resolve().parents[2],
    )


@pytest.mark.slow
def test_under_emulate_host_meets_device_fails_in_the_main_thread_and_a_worker_and_offload_works(
    tmp_path: Path,
) -> None:
    code = """
import threading, weakref, torch
from concurrent.futures import ThreadPoolExecutor
def mix():
    return torch.ones(4, 4, device="neuron") + torch.ones(4, 4)
def outcome(fn):
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    return "ran"
print("main:", outcome(mix))
with ThreadPoolExecutor(1) as pool:
    print("worker:", pool.submit(outcome, mix).result())
lin = torch.nn.Linear(4, 4).to("neuron")
print("linear:", outcome(lambda: lin(torch.ones(1, 4))))
lin.to("cpu")
print("back:", lin.weight.device, lin(torch.ones(1, 4)).device, weakref.getweakrefcount(lin.weight))
import torch_neuronx
from diffusers.utils import is_torch_neuronx_available
print("sdk:", torch_neuronx.__version__, is_torch_neuronx_available())
"""
    done = emulate(tmp_path, code)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    for where in ("main", "worker", "linear"):
        assert lines[where].startswith("neuron rule: " + SAME_DEVICE), (where, lines[where])
    assert lines["back"] == "cpu cpu 0"
    assert lines["sdk"] == "2.13.3.1+emulated True"
    assert "device memory" in done.stderr and "peak" in done.stderr


def test_the_neuron_backend_does_not_take_the_emulators_stand_in_for_an_sdk(tmp_path: Path) -> None:
    """Under `emulate`, diffusers finds an emulated `torch_neuronx` (version `+emulated`); the app's neuron backend
    must not read it as an installed TorchNeuron."""
    done = emulate(
        tmp_path,
        "import importlib.metadata as m\n"
        "from neuron_app.backends.neuron_sdk import installed_version\n"
        "print('SEEN', m.version('torch-neuronx'), 'BACKEND', installed_version())\n",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "SEEN 2.13.3.1+emulated BACKEND None" in done.stdout, done.stdout


def test_at_lnc_1_two_neighbouring_cores_share_one_bank_and_at_lnc_2_each_has_its_own() -> None:
    """U6: AWS's Logical NeuronCore page: at LNC=1 "both physical NeuronCores have access to the entire 24GB HBM
    bank" (one core may hold 20 GB, as AWS's device-memory example has it); the two together share it."""
    import torch

    from neuron_app.backends.emulator.numbering import DeviceState
    from neuron_app.backends.emulator.placement import DeviceMemory

    lnc1, lnc2 = DeviceState(), DeviceState()
    lnc1.hold([4, 5, 6], lnc=1)  # cores 4 and 5 share bank 2; core 6 is on bank 3
    lnc2.hold([1, 2], lnc=2)
    assert [lnc1.bank(i) for i in range(3)] == [2, 2, 3] and lnc1.bank_cores(1) == [4, 5]
    shared = DeviceMemory(1000, bank_of=lnc1.bank)
    big, other = torch.empty(700, dtype=torch.uint8), torch.empty(400, dtype=torch.uint8)
    assert shared.claim(big, index=0) is None  # 700 of one core's 1000: past half the bank, as AWS allows
    assert shared.claim(other, index=1) == (400, 700)  # its neighbour: the bank holds 700, 400 more do not fit
    assert shared.claim(other, index=2) is None  # core 6, another bank
    assert (shared.in_use_of(0), shared.in_use_of(1), shared.in_use_of(2)) == (700, 0, 400)
    own = DeviceMemory(1000, bank_of=lnc2.bank)
    assert own.claim(big, index=0) is None and own.claim(torch.empty(400, dtype=torch.uint8), index=1) is None
