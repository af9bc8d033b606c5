"""NeuronCore ownership on the emulator (issue 43): a core is held by one process at a time, as the Neuron runtime
does; the second process to open a held core fails at start in one line naming the core and the holder's pid."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from neuron_app.errors import DeviceUnavailable
from tests.support import ROOT

HOLD = (
    "import sys\n"
    "from neuron_app.backends.emulator import cores\n"
    "print(cores.acquire(), flush=True)\n"
    "sys.stdin.readline()\n"  # holds its cores until the test closes its stdin (or kills it)
)


@pytest.fixture
def holders() -> Iterator[Any]:
    """Start a process that takes cores as the runtime would (its environment) and holds them; killed at the end."""
    started: list[subprocess.Popen[str]] = []

    def hold(**env: str) -> tuple[subprocess.Popen[str], str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLD],
            cwd=ROOT,
            env=os.environ | env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()  # the cores it took, or nothing when it failed
        if not line:
            return proc, proc.communicate(timeout=60)[1].strip().splitlines()[-1]
        return proc, line

    yield hold
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_the_runtime_variables_are_read_as_the_runtime_reads_them() -> None:
    from neuron_app.backends.emulator.cores import instance, requested

    assert instance({}).cores == 4  # trn2.3xlarge: 8 physical NeuronCore-v3, LNC=2
    assert instance({"NEURON_LOGICAL_NC_CONFIG": "1"}).cores == 8
    assert instance({"NEURON_EMULATOR_INSTANCE": "trn2.48xlarge"}).cores == 64
    assert requested({}) == ([0, 1, 2, 3], 4)  # neither variable: every core
    assert requested({"NEURON_RT_VISIBLE_CORES": "2,3"}) == ([2, 3], 2)
    assert requested({"NEURON_RT_VISIBLE_CORES": "0-1", "NEURON_RT_NUM_CORES": "1"}) == ([0, 1], 2)
    assert requested({"NEURON_RT_NUM_CORES": "2"}) == (None, 2)  # any two free ones
    # A torchrun rank before init_process_group asks for what it sees (TorchNeuron sets its core only there).
    assert requested({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == ([0, 1, 2, 3], 4)
    with pytest.raises(DeviceUnavailable, match=r"names NeuronCore 4, but the emulated trn2\.3xlarge has cores 0-3"):
        requested({"NEURON_RT_VISIBLE_CORES": "4"})
    with pytest.raises(DeviceUnavailable, match="not contiguous"):
        requested({"NEURON_RT_VISIBLE_CORES": "0,2"})


def test_a_held_core_refuses_a_second_process_and_a_killed_holder_frees_it(holders: Any) -> None:
    first, cores = holders(NEURON_RT_VISIBLE_CORES="1")
    assert cores == "[1]"
    second, error = holders(NEURON_RT_VISIBLE_CORES="0-1")
    assert second.returncode != 0
    assert error.startswith("neuron_app.errors.DeviceUnavailable: NeuronCore 1 of the emulated trn2.3xlarge")
    assert f"held by process {first.pid} (NEURON_RT_VISIBLE_CORES=0-1)" in error
    assert holders(NEURON_RT_NUM_CORES="2")[1] == "[2, 3]"  # the first two free cores in a row
    assert "held by process" in holders(LOCAL_RANK="0")[1]  # before init_process_group: every core, as any process
    assert "held by process" in holders()[1]  # every core, and none is free now
    first.kill()  # SIGKILL: no clean-up runs, the kernel drops its locks
    first.wait(timeout=30)
    assert holders(NEURON_RT_VISIBLE_CORES="1")[1] == "[1]"


def test_one_process_opening_its_cores_again_keeps_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from neuron_app.backends.emulator import cores

    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "3")
    assert cores.acquire() == [3] and cores.acquire() == [3] and 3 in cores.held()


@pytest.mark.slow
def test_two_neuron_emulated_apps_on_the_same_cores_cannot_both_start(run_app_py: Any) -> None:
    """The issue's check: the second app with the same NEURON_RT_VISIBLE_CORES exits at start with one line naming
    the core and the first app's pid; an app on another core starts beside it."""
    first = run_app_py(device="neuron-emulated", env={"NEURON_RT_VISIBLE_CORES": "0"})
    first.wait_up()
    second = run_app_py(device="neuron-emulated", env={"NEURON_RT_VISIBLE_CORES": "0"})
    assert second.proc.wait(timeout=300) == 2, second.output()[-3000:]
    lines = [x for x in second.output().splitlines() if "NeuronCore" in x]
    assert len(lines) == 1 and "Traceback" not in second.output(), second.output()[-3000:]
    assert lines[0].startswith("error: NeuronCore 0 of the emulated trn2.3xlarge is held by process ")
    assert f"held by process {first.proc.pid} (NEURON_RT_VISIBLE_CORES=0)" in lines[0], lines[0]
    third = run_app_py(device="neuron-emulated", env={"NEURON_RT_VISIBLE_CORES": "1"})
    third.wait_up()
    assert first.proc.poll() is None and third.proc.poll() is None


def test_a_planted_link_in_the_core_folder_is_refused_and_its_target_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Red-team row 34: a symbolic link (or a hard link) planted as a core file made `acquire()` truncate its target
    and write a pid into it. Now the core file is opened without following links and must be a plain file."""
    from neuron_app.backends.emulator import cores

    victim = tmp_path / "victim.txt"
    victim.write_text("the victim's data\n")
    planted = tmp_path / "cores" / "trn2.3xlarge"
    planted.mkdir(parents=True)
    (planted / "core-0").symlink_to(victim)
    os.link(victim, planted / "core-1")
    monkeypatch.setenv("NEURON_EMULATOR_CORES_DIR", str(tmp_path / "cores"))
    for core, why in (("0", "is a symbolic link: refused"), ("1", "is not a plain file of its own")):
        monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", core)
        with pytest.raises(DeviceUnavailable, match=why):
            cores.acquire()
    assert victim.read_text() == "the victim's data\n"
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "2")
    assert cores.acquire() == [2] and (planted / "core-2").stat().st_mode & 0o777 == 0o600


def test_the_default_core_folder_is_private_to_its_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Row 34's other half: the default folder was a predictable path another local user could make first. It is
    now per uid, made 0700, and refused when it is a link, someone else's or writable by others."""
    import stat
    import tempfile

    from neuron_app.backends.emulator import cores

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    root = tmp_path / f"neuron-emulator-cores-{os.getuid()}"
    assert cores.folder({}) == root / "trn2.3xlarge"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    root.chmod(0o777)  # as if another user had made it first, open to all
    with pytest.raises(DeviceUnavailable, match="is not a private folder of this user's"):
        cores.folder({})
    root.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    root.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(DeviceUnavailable, match="is not a private folder of this user's"):
        cores.folder({})


READER = (
    "import fcntl, os, sys\n"
    "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
    "fcntl.lockf(fd, fcntl.LOCK_SH)\n"  # a reader's shared lock on a read-only descriptor
    "print('locked', flush=True)\n"
    "sys.stdin.readline()\n"
)


def test_a_core_locked_by_a_reader_names_the_reader_not_the_pid_in_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Red-team row 35: a read-only shared lock denies the core (as any lock does), and the message used to name
    the pid written in the file (a dead holder's). It names the process the kernel says holds the lock."""
    from neuron_app.backends.emulator import cores

    where = tmp_path / "cores" / "trn2.3xlarge"
    where.mkdir(parents=True)
    (where / "core-1").write_text("999999")  # a dead holder's pid, left behind
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(where / "core-1")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert reader.stdout is not None and reader.stdout.readline().strip() == "locked"
        monkeypatch.setenv("NEURON_EMULATOR_CORES_DIR", str(tmp_path / "cores"))
        monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "1")
        with pytest.raises(DeviceUnavailable) as info:
            cores.acquire()
        assert f"NeuronCore 1 of the emulated trn2.3xlarge is held by process {reader.pid} " in str(info.value)
        assert "999999" not in str(info.value)
    finally:
        reader.communicate("\n", timeout=60)
