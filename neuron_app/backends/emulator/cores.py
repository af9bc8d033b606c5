"""NeuronCore ownership on the emulator: a core is held by one process at a time, as the Neuron runtime does.

The runtime reserves the cores a process asks for when it starts (`NEURON_RT_VISIBLE_CORES`, else
`NEURON_RT_NUM_CORES` free cores, else every core of the instance), and "once a NeuronCore is reserved for a
process, it cannot be used by another process at all, until the process reserving that NeuronCore is terminated"
(AWS, Neuron Runtime configuration guide). TorchNeuron gives a torchrun rank the core of its `LOCAL_RANK` when
`NEURON_RT_VISIBLE_CORES` is unset, at `init_process_group` (`numbering.on_process_group` sets the variable), not
at start: before it a rank asks for what it sees, like any process; after it a rank holds exactly one core. Here
each core of the emulated instance is a file in one folder per machine
and instance; holding a core is an `fcntl` lock on its file, which the kernel drops when the process dies (a
SIGKILLed holder frees its cores), and never before: as on the device, a process keeps its cores until it exits.

The instance: `NEURON_EMULATOR_INSTANCE` (default trn2.3xlarge: one Trainium2 of 8 physical NeuronCore-v3, 4
logical cores at the default `NEURON_LOGICAL_NC_CONFIG=2`). The folder: `NEURON_EMULATOR_CORES_DIR` (default
under the system's temp folder), so that tests can give each test a machine of its own.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from neuron_app.backends.emulator.numbering import ONE_DEVICE_PER_RANK, STATE
from neuron_app.environment import VISIBLE_CORES_VAR, parse_cores
from neuron_app.errors import DeviceUnavailable

NUM_CORES_VAR = "NEURON_RT_NUM_CORES"
INSTANCE_VAR = "NEURON_EMULATOR_INSTANCE"
CORES_DIR_VAR = "NEURON_EMULATOR_CORES_DIR"
LNC_VAR = "NEURON_LOGICAL_NC_CONFIG"
DEFAULT_INSTANCE = "trn2.3xlarge"
#: Instance -> (chips, physical NeuronCores per chip, whether LNC groups them): AWS's Trn2 architecture page
#: (Trainium2: 8 NeuronCore-v3, grouped by LNC, default 2). Trn2 only: TorchNeuron, what the app serves with,
#: runs on Trn2 and Trn3, and no Trn1 instance is offered anywhere (tests/test_deploy.py).
INSTANCES: dict[str, tuple[int, int, bool]] = {
    "trn2.3xlarge": (1, 8, True),
    "trn2.48xlarge": (16, 8, True),
}

#: HBM per chip, by instance family (AWS's Trn1 and Trn2 instance pages).
HBM_PER_CHIP_GIB = {"trn1": 32.0, "trn2": 96.0}
#: This process's held cores: lock file -> open descriptor. Never closed: closing any descriptor of a file drops
#: every fcntl lock this process has on it (POSIX), and the runtime keeps its cores until the process exits.
_HELD: dict[Path, int] = {}
_LOCK = threading.Lock()


@dataclass(frozen=True)
class Instance:
    name: str
    cores: int  # logical NeuronCores the runtime exposes


def instance(env: Mapping[str, str] | None = None) -> Instance:
    """The emulated instance and its logical core count (LNC read as the runtime reads it)."""
    env = os.environ if env is None else env
    name = env.get(INSTANCE_VAR, "").strip() or DEFAULT_INSTANCE
    if name not in INSTANCES:
        known = ", ".join(INSTANCES)
        raise DeviceUnavailable(f"{INSTANCE_VAR}={name!r} is not an emulated instance: use one of {known}")
    chips, physical, grouped = INSTANCES[name]
    return Instance(name, chips * physical // lnc(env) if grouped else chips * physical)


def hbm_per_core_gib(env: dict[str, str] | None = None) -> float:
    """The HBM one logical core allocates from, its bank (`NEURON_EMULATOR_HBM_GIB` overrides): a Trainium2 has
    four 24 GiB banks, each shared by two physical NeuronCore-v3 (AWS, Logical NeuronCore configuration): a core's
    own at LNC=2, shared with its neighbour at LNC=1 (`numbering.DeviceState.bank`), 24 GiB either way."""
    env = dict(os.environ) if env is None else env
    if env.get("NEURON_EMULATOR_HBM_GIB", "").strip():
        return float(env["NEURON_EMULATOR_HBM_GIB"])
    found = instance(env)
    physical = INSTANCES[found.name][1]
    return HBM_PER_CHIP_GIB[found.name.split(".")[0]] / (physical // 2)  # two physical cores per bank


def lnc(env: Mapping[str, str] | None = None) -> int:
    """`NEURON_LOGICAL_NC_CONFIG` as the runtime reads it: physical cores per logical core (2 by default)."""
    env = os.environ if env is None else env
    text = env.get(LNC_VAR, "2").strip() or "2"
    if text not in ("1", "2"):
        raise DeviceUnavailable(f"{LNC_VAR}={text!r}: a Trainium2 takes 1 or 2")
    return int(text)


def folder(env: Mapping[str, str] | None = None) -> Path:
    """The machine's core files for this instance (one folder per machine and instance). The default is private
    to this user (`neuron-emulator-cores-<uid>` in the temp folder, 0700, checked to be ours: another local user
    cannot plant links or files there first; red-team row 34); NEURON_EMULATOR_CORES_DIR is the user's choice."""
    env = os.environ if env is None else env
    given = env.get(CORES_DIR_VAR)
    root = Path(given) if given else Path(tempfile.gettempdir()) / f"neuron-emulator-cores-{os.getuid()}"
    if not given:
        _private(root)
    return root / instance(env).name


def _private(root: Path) -> None:
    """Make (0700) or accept the default folder only when it is a real folder of this user's that no one else can
    write into."""
    try:
        root.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(root)
    except OSError as exc:
        raise DeviceUnavailable(f"the emulator's core folder {root} cannot be made: {exc}") from exc
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise DeviceUnavailable(
            f"the emulator's core folder {root} is not a private folder of this user's (a link, someone else's, "
            f"or writable by others): remove it or set {CORES_DIR_VAR}"
        )


def requested(env: Mapping[str, str] | None = None) -> tuple[list[int] | None, int]:
    """What the process asks the runtime for: (exact cores, None when any free ones do) and how many."""
    env = os.environ if env is None else env
    total = instance(env).cores
    visible = env.get(VISIBLE_CORES_VAR, "").strip()
    if visible:
        try:
            first, last = parse_cores(visible)
        except ValueError as exc:
            raise DeviceUnavailable(f"{VISIBLE_CORES_VAR}: {exc}") from exc
        if last >= total:
            raise DeviceUnavailable(
                f"{VISIBLE_CORES_VAR}={visible} names NeuronCore {last}, but the emulated {instance(env).name} has "
                f"cores 0-{total - 1} ({INSTANCE_VAR}, {LNC_VAR})"
            )
        return list(range(first, last + 1)), last - first + 1
    number = env.get(NUM_CORES_VAR, "").strip()
    if number and number != "0":  # 0 means all
        if not number.isdigit() or int(number) > total:
            raise DeviceUnavailable(f"{NUM_CORES_VAR}={number!r}: give 1 to {total} (the emulated instance's cores)")
        return None, int(number)
    return list(range(total)), total


#: Core file -> the pid the kernel names as holding the lock that refused us (0: it cannot tell).
_BLOCKERS: dict[Path, int] = {}
_FLOCK = "hhqqi"  # struct flock on Linux: l_type, l_whence, l_start, l_len, l_pid


def _holder(path: Path) -> str:
    """The live holder as the kernel names it (F_GETLK: a reader's shared lock too, red-team row 35), not the pid
    a holder once wrote into the file."""
    pid = _BLOCKERS.get(path, 0)
    return str(pid) if pid > 0 else "that this process cannot tell (the lock's owner is not named)"


def _blocker(fd: int) -> int:
    try:
        answer = fcntl.fcntl(fd, fcntl.F_GETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, 0, 0, 0, 0))
    except OSError:
        return 0
    kind, *_, pid = struct.unpack(_FLOCK, answer[: struct.calcsize(_FLOCK)])
    return pid if kind != fcntl.F_UNLCK else 0


def _open(path: Path) -> int:
    """A core's file, never through a symbolic link (red-team row 34: a planted link to someone's file had it
    truncated) and only a plain file of one name (a hard link to another file is refused too)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DeviceUnavailable(f"{path} is a symbolic link: refused (core files are plain files)") from exc
        raise DeviceUnavailable(f"{path} cannot be opened: {exc.strerror}") from exc
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        raise DeviceUnavailable(f"{path} is not a plain file of its own (a hard link or a device): refused")
    return fd


def _try(path: Path) -> int | None:
    """Lock one core's file for this process; its descriptor, or None when a live process holds it."""
    fd = _open(path)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        _BLOCKERS[path] = _blocker(fd)
        os.close(fd)
        return None
    os.ftruncate(fd, 0)  # our own plain file (checked above), never a link's target
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _take(paths: list[Path]) -> Path | None:
    """Take every core in `paths` or none of them; the first one held by another process, else None."""
    new: list[tuple[Path, int]] = []
    for path in paths:
        if path in _HELD:
            continue
        fd = _try(path)
        if fd is None:
            for taken, taken_fd in new:
                os.close(taken_fd)  # none of these was ours before: closing drops only this attempt's locks
                _HELD.pop(taken, None)
            return path
        new.append((path, fd))
        _HELD[path] = fd
    return None


def acquire(env: Mapping[str, str] | None = None) -> list[int]:
    """Reserve this process's cores as the runtime does at start; `DeviceUnavailable` in one line naming the core
    and the holder's pid when a live process holds one. Asking again in the same process keeps what it has."""
    env = os.environ if env is None else env
    inst, where = instance(env), folder(env)
    exact, count = requested(env)
    if STATE.local_world_size is not None and count != 1:  # TorchNeuron asserts one core per rank (after nrt_init)
        raise DeviceUnavailable(
            f"{ONE_DEVICE_PER_RANK} (neuron-emulated: {VISIBLE_CORES_VAR}={env.get(VISIBLE_CORES_VAR, '')} gives this "
            f"rank {count} NeuronCores; give each rank its own core, NEURON_RT_VISIBLE_CORES=<base + LOCAL_RANK>)"
        )
    where.mkdir(parents=True, exist_ok=True)

    def files(cores: list[int]) -> list[Path]:
        return [where / f"core-{n}" for n in cores]

    with _LOCK:
        if exact is not None:
            busy = _take(files(exact))
            if busy is None:
                return _numbered(exact, env)
            asked = env.get(VISIBLE_CORES_VAR) or (f"LOCAL_RANK={env['LOCAL_RANK']}" if "LOCAL_RANK" in env else "")
            how = f"{VISIBLE_CORES_VAR}={asked}" if env.get(VISIBLE_CORES_VAR) else asked or "every core (the default)"
        else:
            first_busy = None
            for start in range(inst.cores - count + 1):
                cores = list(range(start, start + count))
                busy = _take(files(cores))
                if busy is None:
                    return _numbered(cores, env)
                first_busy = first_busy or busy
            busy, how = first_busy, f"{NUM_CORES_VAR}={count}, no {count} free in a row"
    core = busy.name.removeprefix("core-") if busy is not None else "?"
    holder = _holder(busy) if busy is not None else "unknown"
    raise DeviceUnavailable(
        f"NeuronCore {core} of the emulated {inst.name} is held by process {holder} ({how}): the Neuron runtime "
        f"gives a core to one process until it exits; stop that process or set {VISIBLE_CORES_VAR} to free cores"
    )


def _numbered(cores: list[int], env: Mapping[str, str]) -> list[int]:
    """The cores held are this process's devices from now on: `neuron:N` is the N-th (`numbering.py`)."""
    STATE.hold(cores, lnc(env))
    return cores


def free_cores(env: Mapping[str, str] | None = None) -> list[int]:
    """The cores of the emulated instance no live process holds now (this one's own count as taken)."""
    env = os.environ if env is None else env
    where, free = folder(env), []
    where.mkdir(parents=True, exist_ok=True)
    with _LOCK:
        for n in range(instance(env).cores):
            path = where / f"core-{n}"
            if path in _HELD:
                continue
            fd = _try(path)
            if fd is not None:
                free.append(n)
                os.close(fd)  # not ours before: closing drops only this probe's lock
    return free


def free_count(env: Mapping[str, str] | None = None) -> int:
    return len(free_cores(env))


def held() -> list[int]:
    """The cores this process holds, in every emulated instance it opened (for the status)."""
    with _LOCK:
        return sorted(int(p.name.removeprefix("core-")) for p in _HELD)
