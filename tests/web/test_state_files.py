"""Issue 52 row 20: files of ours in a state folder that others can write are never opened through a link. The red
team's `ln -s victim2.txt stateS/state.lock` made the app truncate the link's target and write its pid there."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from neuron_app.errors import SettingsError
from neuron_app.web.jobs.sqlite_file import hold
from neuron_app.web.jobs.usage_book import UsageBook
from tests.support import AppProcess

VICTIM = "the victim's important data\n"


def test_a_planted_state_lock_link_stops_the_start_and_its_target_stays_untouched(
    run_app_py: Callable[..., AppProcess], tmp_path: Path
) -> None:
    """`python app.py` on a state folder where someone planted `state.lock -> victim`: exit 2, one line naming
    the file and the setting, no traceback, no server path; the victim's bytes and time stamp unchanged."""
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM, encoding="utf-8")
    before = victim.stat()
    state = tmp_path / "shared-state"
    state.mkdir()
    (state / "state.lock").symlink_to(victim)
    app = run_app_py(state_dir=str(state))
    assert app.proc.wait(timeout=300) == 2, app.output()[-2000:]
    out = app.output()
    assert "state.lock in the state folder" in out and "NEURON_APP_STATE_DIR" in out, out[-2000:]
    assert "Traceback" not in out and str(state) not in out and str(victim) not in out
    assert victim.read_text(encoding="utf-8") == VICTIM and victim.stat().st_mtime_ns == before.st_mtime_ns
    assert not (state / "jobs.sqlite3").exists()  # refused before anything was opened


@pytest.mark.parametrize("plant", ["hardlink", "fifo"])
def test_a_state_lock_that_is_not_a_plain_file_of_ours_is_refused(tmp_path: Path, plant: str) -> None:
    """A second name of another file (a hard link) or a FIFO in place of `state.lock`: refused, nothing written."""
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM, encoding="utf-8")
    state = tmp_path / "state"
    state.mkdir()
    if plant == "hardlink":
        os.link(victim, state / "state.lock")
    else:
        os.mkfifo(state / "state.lock")
    with pytest.raises(SettingsError, match="not a plain file of this user"):
        hold(state)
    assert victim.read_text(encoding="utf-8") == VICTIM


def test_a_planted_database_link_is_refused_and_nothing_is_made_through_it(tmp_path: Path) -> None:
    """`usage.sqlite3 -> elsewhere` (a dangling link: SQLite would create its target) or a planted `-wal` link."""
    elsewhere = tmp_path / "elsewhere.db"
    state = tmp_path / "state"
    state.mkdir()
    (state / "usage.sqlite3").symlink_to(elsewhere)
    with pytest.raises(SettingsError, match=r"usage\.sqlite3 in the state folder .* is a link"):
        UsageBook(state / "usage.sqlite3")
    assert not elsewhere.exists()
    (state / "usage.sqlite3").unlink()
    (state / "usage.sqlite3-wal").symlink_to(elsewhere)
    with pytest.raises(SettingsError, match=r"usage\.sqlite3-wal in the state folder .* is a link"):
        UsageBook(state / "usage.sqlite3")
    assert not elsewhere.exists()


def test_a_clean_state_folder_is_taken_and_taken_again(tmp_path: Path) -> None:
    """The lock file made here is the process's own: 0600, plain, holding its pid; taken again after release."""
    handle = hold(tmp_path)
    path = tmp_path / "state.lock"
    assert oct(path.stat().st_mode & 0o777) == "0o600" and f"process {os.getpid()}" in path.read_text()
    handle.close()
    hold(tmp_path).close()
