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


def _env(**extra: str) -> dict[str, str]:
    skip = ("NEURON_APP_", "_NEURON", "NEURON_LOGICAL_NC_CONFIG")
    return {k: v for k, v in os.environ.items() if not k.startswith(skip)} | extra


def _start(*args: str, **env: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "neuron_app", "plan", *args]
    return subprocess.Popen(
        command, cwd=ROOT, env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _rows(process: subprocess.Popen[str]) -> dict[tuple[str, int, str], dict[str, Any]]:
    """Text-to-image rows by (shape, TP, instance); an edit's rows under (shape + " +N ref", TP, instance)."""
    out, err = process.communicate(timeout=900)
    assert process.returncode == 0, err
    rows = json.loads(out)
    return {
        (r["shape"] + (f" +{r['references']} ref" if r["references"] else ""), r["tp"], r["instance"]): r for r in rows
    }


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[tuple[str, int, str], dict[str, Any]]]:
    """Both models' plans, started together (each is one process importing torch and diffusers)."""
    four = _start(
        "--model", "black-forest-labs/FLUX.2-klein-4B", "--shape", "1024x1024", "--tp", "1", "--tp", "2",
        "--instance", "trn2", "--references", "0", "--references", "4", "--json",
    )  # fmt: skip
    nine = _start(
        "--model", "klein-9b", "--shape", "512x512", "--shape", "1024x1024", "--tp", "1", "--tp", "2",
        "--instance", "trn1", "--instance", "trn2", "--instance-type", "trn2.48xlarge", "--json",
    )  # fmt: skip
    lnc1 = _start(
        "--model", "klein-4b", "--shape", "1024x1024", "--instance-type", "trn2.48xlarge", "--json",
        NEURON_LOGICAL_NC_CONFIG="1",
    )  # fmt: skip
    return {"4b": _rows(four), "9b": _rows(nine), "lnc1": _rows(lnc1)}


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
            if row["cores_per_bank"] == 1:  # a core owns its bank: the fullest core is what must fit
                assert row["fits"] == (row["total_gib_per_core"] <= row["hbm_gib_per_core"]), row
            placement = row["placement"]
            assert row["total_gib_per_core"] == max(core["gib"] for core in placement["cores"])
            assert placement["cores_used"] == sum(core["cores"] for core in placement["cores"])
            assert row["floor_s_per_image"] > 0
    together = runs["4b"][("1024x1024", 1, "trn2")]
    weights = sum(c["weights_gib_per_core"] for c in together["components"].values())
    assert together["placement"]["name"] == "together"
    # weights + the largest activation peak + the runtime's micro-code: 96 MB per physical core, 2 per LNC=2 core
    reserve = together["runtime_reserve_gib_per_core"]
    assert reserve == 0.188 and together["lnc"] == 2
    assert abs(together["total_gib_per_core"] - weights - together["activations_gib_per_core"] - reserve) < 0.005


def test_klein_9b_falls_back_to_its_own_cores_and_says_when_nothing_fits(runs: dict[str, Any]) -> None:
    rows = runs["9b"]
    trn2 = rows[("512x512", 1, "trn2")]
    all_weights = sum(c["weights_gib_per_core"] for c in trn2["components"].values())
    assert all_weights > 24  # 9B transformer + the cut Qwen3-8B + the VAE do not share one trn2 core
    assert trn2["fits"] and trn2["placement"]["name"] == "text encoder on its own core"
    assert trn2["placement"]["setting"] == "text-encoder-apart" and trn2["placement"]["cores_used"] == 2
    trn1 = rows[("512x512", 1, "trn1")]
    assert not trn1["fits"] and trn1["total_gib_per_core"] > trn1["hbm_gib_per_core"] == 16.0
    # TP > 1: each torchrun rank holds one core with its shard, a text encoder and a VAE: `together` only, which
    # klein-9B's 10.9 GiB text encoder beside an 8.5 GiB shard does not fit on trn1's 16 GiB (the fifth review's U1:
    # the plan no longer promises a placement the app cannot serve).
    split = rows[("512x512", 2, "trn1")]
    assert split["placement"]["setting"] == "together" and not split["fits"]
    assert split["placement"]["cores_used"] == 2


def test_every_plan_row_names_a_placement_setting_the_app_accepts(runs: dict[str, Any], make_settings: Any) -> None:
    """Issue 50: `plan --model klein-9b --tp 1 --instance trn2` names a `setting`; the settings take it, and each
    row's instance view counts replicas of that placement on the instance."""
    for rows in runs.values():
        for row in rows.values():
            setting = row["placement"]["setting"]
            assert make_settings(placement=setting, tp_degree=row["tp"]).placement == setting
            view = row["instance_view"]
            assert set(view) == {"instance_type", "cores", "replicas", "tp", "images_per_s_floor"}
    nine = runs["9b"][("1024x1024", 1, "trn2")]
    assert nine["fits"] and nine["placement"]["setting"] == "text-encoder-apart"
    # trn2.48xlarge: 16 chips x 4 logical cores, 2 cores per copy: 32 copies, each at most one image per floor
    view = nine["instance_view"]
    assert (view["instance_type"], view["cores"], view["replicas"]) == ("trn2.48xlarge", 64, 32)
    assert abs(view["images_per_s_floor"] - 32 / nine["floor_s_per_image"]) < 0.01
    four = runs["4b"][("1024x1024", 1, "trn2")]["instance_view"]
    assert four["instance_type"] == "trn2.3xlarge" and four["replicas"] == 4  # the family's default size
    # Issue 56: a TP group is one copy on an aligned block (2k, 2k+1): a trn2.3xlarge's 4 cores hold 2 groups
    assert runs["4b"][("1024x1024", 2, "trn2")]["instance_view"]["replicas"] == 2


def test_an_edit_with_four_references_is_planned_as_the_tokens_it_attends_over(runs: dict[str, Any]) -> None:
    """Issue 50 (U3): four 1024x1024 references join the image tokens: 4096 x 5 + 512 = 20,992 joint tokens,
    about 264 TFLOP per step (7.6 times text-to-image), and each reference is encoded once."""
    plain = runs["4b"][("1024x1024", 1, "trn2")]
    edit = runs["4b"][("1024x1024 +4 ref", 1, "trn2")]
    assert edit["references"] == 4 and edit["joint_tokens"] == 20992 and plain["joint_tokens"] == 4608
    assert abs(edit["tflop_per_step"] / 264 - 1) < 0.02 and 7.4 < edit["tflop_per_step"] / plain["tflop_per_step"] < 7.8
    encode = edit["tflop_per_image"] - edit["steps"] * edit["tflop_per_step"] - plain["tflop_per_image"]
    encode += plain["steps"] * plain["tflop_per_step"]
    assert encode > 0  # four VAE encodes on top of one text encode and one decode
    assert (
        edit["components"]["transformer"]["activations_gib"] > 4 * plain["components"]["transformer"]["activations_gib"]
    )


def test_at_lnc_1_two_cores_share_one_bank(runs: dict[str, Any]) -> None:
    """NEURON_LOGICAL_NC_CONFIG=1 as the runtime reads it: 8 cores per Trainium2, two per 24 GB bank (AWS). One
    klein-4B copy (14.9 GiB) fits a core, but two do not share a bank: 64 copies on a trn2.48xlarge, as at LNC=2,
    each on a core with half the compute."""
    one = runs["lnc1"][("1024x1024", 1, "trn2")]
    two = runs["4b"][("1024x1024", 1, "trn2")]
    assert one["lnc"] == 1 and one["cores_per_bank"] == 2 and one["hbm_gib_per_core"] == 24.0 and one["fits"]
    assert one["runtime_reserve_gib_per_core"] == 0.094  # one physical core's micro-code
    assert one["instance_view"]["cores"] == 128 and one["instance_view"]["replicas"] == 64
    assert abs(one["floor_s_per_step"] / two["floor_s_per_step"] - 2) < 0.01


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--shape", "100x100"], "multiple of 16"),
        (["--model", "klein-4b", "--tp", "5"], "does not divide klein-4b's 24 attention heads"),
        (["--model", "klein-9b", "--tp", "3"], "does not divide klein-9b's 32 attention heads"),
        (["--instance", "trn9"], "--instance 'trn9' is not known"),
        (["--model", "flux-dev"], "is not a planned model"),
        (["--model", "klein-4b", "--references", "99"], "--references '99' is not a count"),
        (["--model", "klein-4b", "--instance-type", "p5.48xlarge"], "--instance-type 'p5.48xlarge' is not known"),
        (["--model", "klein-4b", "--placement", "apart"], "--placement 'apart' is not a placement"),
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


def test_an_lnc_the_chip_does_not_take_is_refused_in_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "neuron_app", "plan", "--model", "klein-4b"],
        cwd=ROOT,
        env=_env(NEURON_LOGICAL_NC_CONFIG="3"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "NEURON_LOGICAL_NC_CONFIG=3 is not a setting trn2 takes (1 or 2)" in done.stderr


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
    assert status.plan.startswith("1024x1024: fits, 14.9 of 24 GiB per core (together)"), status.plan
    assert "floor 0.92 s per image" in status.plan and "**Plan** (trn2, TP 1) 1024x1024" in status_markdown(status)
    assert not status.loaded and status.compiles == 0  # before any load or compile
    tiny = PipelineManager(make_settings())
    assert tiny.status().plan is None and "**Plan**" not in status_markdown(tiny.status())
