"""Issue 52 row 36: a klein-4b-random build killed mid-write left its staging folder (3 GB at the red team's kill,
15 GiB for a whole 4B build) and nothing ever removed it. Here a real build runs in a process of its own and is
killed once its staging folder holds bytes; the next start removes the folder, and never a live build's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from neuron_app.engine.model.real.random_weights import folder_name, remove_stale_staging
from tests.support import ROOT, wait_for

BUILD = "import sys; from pathlib import Path; from neuron_app.engine.model.real.random_weights import ensure_random; "
BUILD += "ensure_random(Path(sys.argv[1]), 'klein-4b-random')"


def staging(models: Path) -> list[Path]:
    return [p for p in models.glob(f".{folder_name('klein-4b-random')}-*") if p.is_dir()]


def written(models: Path) -> int:
    return sum(f.stat().st_size for folder in staging(models) for f in folder.rglob("*") if f.is_file())


def test_a_killed_builds_staging_folder_is_removed_at_the_next_start_and_a_live_ones_is_kept(tmp_path: Path) -> None:
    models = tmp_path / "models"
    builder = subprocess.Popen([sys.executable, "-c", BUILD, str(models)], cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: written(models) > 0 or builder.poll() is not None, 600, "the build's first bytes")
        assert builder.poll() is None, "the build ended before it was killed"
        assert remove_stale_staging(models) == [] and staging(models)  # a live build holds its lock: kept
    finally:
        os.kill(builder.pid, signal.SIGKILL)
        builder.wait(60)
    (left,) = staging(models)
    assert written(models) > 0
    assert remove_stale_staging(models) == [left.name]  # the next start, whatever model it serves
    assert not left.exists() and staging(models) == []
    assert not (models / folder_name("klein-4b-random")).exists()  # nothing half-built was renamed into place
