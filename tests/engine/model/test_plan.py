"""`python -m neuron_app plan`, run as users run it: the real klein architectures measured on fake tensors.

The expected figures are worked out here from the published configs (docs/real-size.md), not read back from the
command: the issue's 3.876e9 transformer parameters and 34.8 TFLOP per step at 1024x1024 with 512 text tokens, the
cut Qwen3-4B's parameters by layer arithmetic, and the bytes diffusers' TP plan shards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.support import ROOT

GIB = 2**30


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("NEURON_APP_", "_NEURON"))}


def _start(*args: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "neuron_app", "plan", *args]
    return subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rows(process: subprocess.Popen[str]) -> dict[tuple[str, int, str], dict[str, Any]]:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err
    return {(r["shape"], r["tp"], r["instance"]): r for r in json.loads(out)}


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[tuple[str, int, str], dict[str, Any]]]:
    """Both models' plans, started together (each is one process importing torch and diffusers)."""
    four = _start(
        "--model", "black-forest-labs/FLUX.2-klein-4B", "--shape", "1024x1024", "--tp", "1", "--tp", "2",
        "--instance", "trn2", "--json",
    )  # fmt: skip
    nine = _start(
        "--model", "klein-9b", "--shape", "512x512", "--tp", "1", "--tp", "2", "--instance", "trn1",
        "--instance", "trn2", "--json",
    )  # fmt: skip
    return {"4b": _rows(four), "9b": _rows(nine)}


def test_klein_4b_is_the_published_architecture(runs: dict[str, Any]) -> None:
    row = runs["4b"][("1024x1024", 1, "trn2")]
    assert row["model"] == "black-forest-labs/FLUX.2-klein-4B" and row["spec"] == "klein-4b"
    assert row["steps"] == 4 and row["text_tokens"] == 512
    components = row["components"]
    assert abs(components["transformer"]["params"] / 3.876e9 - 1) < 1e-3
    assert abs(row["tflop_per_step"] / 34.8 - 1) < 0.03
    # Qwen3-4B cut after layer 27 of 36, lm_head dropped (tied): embeddings + 27 layers of q, k, v, o, q/k norms,
    # the SwiGLU MLP and two layer norms.
    hidden, heads_dim, kv_dim, mlp = 2560, 32 * 128, 8 * 128, 9728
    layer = hidden * heads_dim + 2 * hidden * kv_dim + heads_dim * hidden + 2 * 128 + 3 * hidden * mlp + 2 * hidden
    assert components["text_encoder"]["params"] == 151936 * hidden + 27 * layer
    assert 80e6 < components["vae"]["params"] < 90e6  # the FLUX.2 VAE, 84M
    steps_flops = row["steps"] * row["tflop_per_step"]
    assert steps_flops < row["tflop_per_image"] < steps_flops + 20  # plus one text encode and one decode
    assert row["hbm_gib_per_core"] == 24.0  # trn2: 96 GiB per chip, 4 logical cores at LNC=2


def test_tp_2_halves_the_sharded_weights_and_only_those(runs: dict[str, Any]) -> None:
    one = runs["4b"][("1024x1024", 1, "trn2")]["components"]["transformer"]
    two = runs["4b"][("1024x1024", 2, "trn2")]["components"]["transformer"]
    assert one["params"] == two["params"]  # the model's count, not the shard's
    # What diffusers' _tp_plan shards, from the config: per double block q, k, v, o for image and text (3072x3072),
    # two SwiGLU MLPs (3072 -> 2x9216 -> 3072); per single block the fused qkv+MLP projection and its output.
    dim, mlp = 3072, 9216
    double = 8 * dim * dim + 2 * (dim * 2 * mlp + mlp * dim)
    single = dim * (3 * dim + 2 * mlp) + (dim + mlp) * dim
    sharded_gib = (5 * double + 20 * single) * 2 / GIB
    assert abs((one["weights_gib_per_core"] - two["weights_gib_per_core"]) - sharded_gib / 2) < 0.01
    assert 0.49 < two["tflop_per_call_per_core"] / one["tflop_per_call_per_core"] < 0.52
    assert two["activations_gib"] < one["activations_gib"]


def test_fits_is_the_totals_against_the_core(runs: dict[str, Any]) -> None:
    for rows in runs.values():
        for row in rows.values():
            assert row["fits"] == (row["total_gib_per_core"] <= row["hbm_gib_per_core"])
            placement = row["placement"]
            assert row["total_gib_per_core"] == max(core["gib"] for core in placement["cores"])
            assert placement["cores_used"] == sum(core["cores"] for core in placement["cores"])
            assert row["floor_s_per_image"] > 0
    together = runs["4b"][("1024x1024", 1, "trn2")]
    weights = sum(c["weights_gib_per_core"] for c in together["components"].values())
    assert together["placement"]["name"] == "together"
    assert abs(together["total_gib_per_core"] - weights - together["activations_gib_per_core"]) < 0.005


def test_klein_9b_falls_back_to_its_own_cores_and_says_when_nothing_fits(runs: dict[str, Any]) -> None:
    rows = runs["9b"]
    trn2 = rows[("512x512", 1, "trn2")]
    all_weights = sum(c["weights_gib_per_core"] for c in trn2["components"].values())
    assert all_weights > 24  # 9B transformer + the cut Qwen3-8B + the VAE do not share one trn2 core
    assert trn2["fits"] and trn2["placement"]["name"] == "text encoder on its own core"
    assert trn2["placement"]["cores_used"] == 2
    trn1 = rows[("512x512", 1, "trn1")]
    assert not trn1["fits"] and trn1["total_gib_per_core"] > trn1["hbm_gib_per_core"] == 16.0
    split = rows[("512x512", 2, "trn1")]
    assert split["fits"] and split["placement"]["cores_used"] > 2


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--shape", "100x100"], "multiple of 16"),
        (["--model", "klein-4b", "--tp", "5"], "does not divide klein-4b's 24 attention heads"),
        (["--model", "klein-9b", "--tp", "3"], "does not divide klein-9b's 32 attention heads"),
        (["--instance", "trn9"], "--instance 'trn9' is not known"),
        (["--model", "flux-dev"], "is not a planned model"),
    ],
)
def test_bad_input_is_refused_in_one_line(args: list[str], says: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "neuron_app", "plan", *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and not done.stdout
    assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_the_status_shows_the_plan_of_the_served_model_before_any_compile(make_settings: Any) -> None:
    """Issue 43: the page's status says what the served model needs per core and its floor, from `plan`, measured
    on its own thread (a status read never waits for it); a tiny model has no plan line."""
    from neuron_app.engine.manager import PipelineManager
    from neuron_app.web.page.views import status_markdown

    manager = PipelineManager(
        make_settings(
            model="black-forest-labs/FLUX.2-klein-4B", resolutions=["1024x1024"], default_resolution="1024x1024"
        )
    )
    manager.status()  # the first read starts the measurement
    assert manager._plan_line.done.wait(300)
    status = manager.status()
    assert status.plan.startswith("1024x1024: fits, 14.7 of 24 GiB per core"), status.plan
    assert "floor 0.92 s per image" in status.plan and "**Plan** (trn2, TP 1) 1024x1024" in status_markdown(status)
    assert not status.loaded and status.compiles == 0  # before any load or compile
    tiny = PipelineManager(make_settings())
    assert tiny.status().plan is None and "**Plan**" not in status_markdown(tiny.status())
