"""python -m neuron_app train-tiny: a short run of the real training code, whose losses fall."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from tests.support import run_cli, tiny_env


def _losses(log: list[dict], stage: str) -> list[float]:
    return [row["loss"] for row in log if row.get("stage") == stage and "loss" in row]


@pytest.mark.slow
def test_train_tiny_twelve_steps_a_stage_the_losses_fall(tmp_path: Path) -> None:
    """A budget in steps (`--steps`), not minutes: the same run on a quiet or a busy machine (a two-minute budget
    gave a busy machine fewer steps; 59 s here when quiet, where the two minutes took 126 s in the suite)."""
    out = tmp_path / "tiny-shapes"
    done = run_cli(
        tiny_env(tmp_path / "cache"),
        *("train-tiny", "--steps", "12", "--threads", "1", "--mismatch-share", "0.2", "--out", str(out)),
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    log = [json.loads(line) for line in (out / "train-log.jsonl").read_text().splitlines()]
    # Twelve steps are enough for the transformer's loss to fall (2.04 to 1.87 over the first and last three, seed 0).
    # The VAE starts from 8x8 pooling set by hand (a random one reconstructs at MSE ~0.3-0.6): its dozen steps here
    # keep it reconstructing. The LoRA's stage (twelve noisy flow-loss steps) only has to run: its fall shows in the
    # full runs' logs.
    losses = _losses(log, "transformer")
    assert len(losses) == 12
    head, tail = losses[: max(3, len(losses) // 5)], losses[-max(3, len(losses) // 5) :]
    assert statistics.mean(tail) < statistics.mean(head), (head, tail)
    vae = _losses(log, "vae")
    assert len(vae) == 12 and max(vae) < 0.08, vae
    assert len(_losses(log, "lora")) == 12
    assert (out / "model_index.json").is_file() and (out / "lora" / "outline.safetensors").is_file()
    summary = json.loads((out / "tiny_recipe.json").read_text())
    assert summary["plan"]["steps"] == 12 and summary["plan"]["mismatch_share"] == 0.2  # the flags reached the plan
    assert set(summary["eval_128x128_4_steps"]) >= {"colour", "shape"}


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--out", "FILE"), "--out must be a folder"),
        (("--minutes", "nan"), "--minutes must be a positive number"),
        (("--minutes", "-5"), "--minutes must be a positive number"),
        (("--threads", "-3"), "--threads must be 0"),
        (("--steps", "-1"), "--steps must be 0"),
        (("--lr", "inf"), "--lr must be 0"),
        (("--init", "/"), "--init must be a saved pipeline's folder"),
    ],
)
def test_train_tiny_refuses_hostile_arguments_in_one_line(tmp_path: Path, args: tuple[str, ...], says: str) -> None:
    """Issue 45, row 50: `--out /etc/passwd` made `/etc/passwd.training/`, NaN or negative budgets gave tracebacks or
    ran; each is now one line and exit 2, before torch loads, and nothing is written."""
    target = tmp_path / "passwd"
    target.write_text("root:x:0:0\n")
    args = tuple(str(target) if a == "FILE" else a for a in args)
    done = run_cli(tiny_env(tmp_path / "cache"), "train-tiny", *args, timeout=120)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr[-1000:]
    assert (
        sorted(p.name for p in tmp_path.iterdir()) == ["cache", "passwd"] or not (tmp_path / "passwd.training").exists()
    )
