"""SQLite files the app keeps (the job store, the usage book), opened the same defensive way.

Stored state outlives the process that wrote it, so it is read as untrusted: a file that is not a database
(overwritten, truncated, a disk fault) or fails its quick check is kept aside as `<name>.corrupt-<time>` (with its
WAL, never replayed into the new one), one ERROR line says so, and a fresh database is made: the server starts.
A file that is locked, read-only or on a full disk may be sound, so it is left where it is and the error raised.

SQLite's WAL needs one host's shared memory, and a restart marks every unfinished job of the store failed: so a
state folder belongs to one process. `hold` takes `state.lock` (a POSIX lock: per process, and what NFS and EFS
support) for the process's life, and a second process on the same folder is refused at start with the reason.

A state folder may be shared with other users (a group-writable mount): nothing of ours there is opened through a
link. `state.lock` is opened with O_NOFOLLOW and must be a plain file of this user with one name; a database, its
WAL or its shared memory that is a link is refused at start (issue 52, row 20: a planted `state.lock` symlink
truncated its target).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import sqlite3
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from neuron_app.errors import SettingsError, one_line

log = logging.getLogger(__name__)
Prepare = Callable[[sqlite3.Connection], object]


class Unsound(sqlite3.DatabaseError):
    """A database that opens but fails its integrity check."""


def open_checked(
    path: Path, prepare: Callable[[sqlite3.Connection], None], what: str, fresh: str
) -> sqlite3.Connection:
    """The database at `path` in WAL mode, checked, then `prepare`d (its schema); `what` and `fresh` word the
    line logged when a corrupt file is kept aside ("job store", "starting with no jobs")."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for suffix in ("", "-wal", "-shm"):  # SQLite follows links: one planted here would write through it
        if path.with_name(path.name + suffix).is_symlink():
            raise SettingsError(_not_ours(path.name + suffix))
    try:
        return _connect(path, prepare)
    except sqlite3.DatabaseError as exc:
        if not _corrupt(exc):
            raise  # locked, read-only, no room: the file may be sound, so it is left where it is
        aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
        for suffix in ("", "-wal", "-shm"):  # the WAL belongs to the bad file: never replayed into the new one
            source = path.with_name(path.name + suffix)
            if source.exists():
                source.replace(aside.with_name(aside.name + suffix))
        log.error("%s %s is unreadable (%s): kept aside as %s; %s", what, path.name, one_line(exc, limit=120),
                  aside.name, fresh)  # fmt: skip
        return _connect(path, prepare)


def _corrupt(exc: sqlite3.DatabaseError) -> bool:
    """Not a database, or a damaged one (SQLITE_NOTADB, SQLITE_CORRUPT and its extended codes)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(exc, Unsound) or (
        code is not None and code & 0xFF in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT)
    )


def _connect(path: Path, prepare: Prepare) -> sqlite3.Connection:
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=10)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        (verdict,) = db.execute("PRAGMA quick_check(1)").fetchone()
        if verdict != "ok":
            raise Unsound(f"quick_check: {verdict}")
        prepare(db)
    except BaseException:
        db.close()
        raise
    return db


def hold(folder: Path) -> IO[str]:
    """Take the state folder for this process (kept until the handle is closed), or SettingsError naming who
    holds it. The same process may take it again (an in-process restart)."""
    folder.mkdir(parents=True, exist_ok=True)
    handle = _open_own(folder / "state.lock")
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise SettingsError(
            f"the state folder (state_dir, else cache_dir) is in use by {holder}: its job store and usage book "
            "belong to one process (SQLite's WAL is not safe across processes or hosts). Give each process its "
            "own NEURON_APP_STATE_DIR on local disk (docs/kubernetes.md), or stop the other one"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"process {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    return handle


def _open_own(path: Path) -> IO[str]:
    """`path` for reading and writing, never through a link, and only if it is a plain file of this user with
    one name (else SettingsError): what is written to it then lands in no other file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK, errno.ENXIO):  # a symlink (EMLINK: FreeBSD), a FIFO or socket
            raise SettingsError(_not_ours(path.name)) from None
        raise
    found = os.fstat(fd)
    if not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid() or found.st_nlink != 1:
        os.close(fd)
        raise SettingsError(_not_ours(path.name))
    os.set_blocking(fd, True)
    return os.fdopen(fd, "r+")


def _not_ours(name: str) -> str:
    return (
        f"{name} in the state folder (state_dir, else cache_dir) is a link, or not a plain file of this user: "
        "nothing is written through it. Remove it if it is yours, or give the process a folder of its own "
        "(NEURON_APP_STATE_DIR)"
    )
