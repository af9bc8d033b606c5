"""`python -m neuron_app selftest` on neuron-emulated, run as a user runs it: every check of the second review's
"First device check" gives a verdict, the JSON report is written, and the checks that can fail here do not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT


@pytest.mark.slow
@pytest.mark.timeout(3000)  # about ten processes, one at a time, each loading and compiling: minutes on 2 shared cores
def test_the_selftest_runs_every_check_and_writes_its_report(tmp_path: Path) -> None:
    report = tmp_path / "selftest.json"
    report_to = ["--report", str(report)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEURON_APP_", "TORCH_NEURONX_"))}
    env["NEURON_APP_CACHE_DIR"] = str(tmp_path / "app-cache")  # where the tiny model is built once
    done = subprocess.run(
        # The compiled TP path runs once in the suite: the TP check's own test below (`--skip tp` here).
        [sys.executable, "-m", "neuron_app", "selftest", "--device", "neuron-emulated", "--skip", "tp", *report_to],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    data = json.loads(report.read_text())
    checks = {c["check"]: c for c in data["checks"]}
    assert data["device"] == "neuron-emulated" and data["model"] == "tiny" and data["failed"] == 0
    assert "NKI attention eligible (predicted" in checks["profile 128x64"]["found"]  # 32 + 480 = 512 (T10)
    assert "NKI attention no (decomposed attention" in checks["profile 64x64"]["found"]  # 16 + 480 = 496
    assert "scatter_.src" in checks["profile 64x64"]["found"] and checks["profile 64x64"]["verdict"] == "pass"
    assert (
        checks["restart (2nd process)"]["verdict"] == "pass" and "0 eager" in checks["restart (2nd process)"]["found"]
    )
    assert checks["img2img/inpaint ready"]["verdict"] == "pass"
    assert checks["edit ready"]["verdict"] == "pass" and "0 graph(s), 0 eager" in checks["edit ready"]["found"]
    assert checks["LoRA switch"]["verdict"] == "pass" and ": 0, 0, 0 compile(s)" in checks["LoRA switch"]["found"]
    for tile in (256, 384, 512):
        assert "PSNR" in checks[f"VAE tile {tile} px"]["found"] and checks[f"VAE tile {tile} px"]["verdict"] != "fail"
    assert checks["TP=2 equals TP=1"]["found"] == "skipped (--skip tp)"
    copy, graph = checks["core-to-core copy"], checks["compiled graph runs on"]  # the emulator's rules, one line each
    assert "refused (NeuronRuleViolation: neuron rule: Device-to-device copy requires tensors on same" in copy["found"]
    assert graph["found"].startswith("the current device: called with current device neuron:0 and inputs on neuron:1")
    assert f"selftest: {len(checks)} checks, 0 failing" in done.stdout


def test_a_check_started_beside_a_process_holding_the_cores_cannot_start(make_settings: Any, tmp_path: Path) -> None:
    """T1 on the emulator: the old selftest kept its manager (every NeuronCore of the instance) while it started its
    checks' processes; with the runtime's core ownership each of them now fails at start, naming the holder, as
    it would on a trn2. The selftest's own processes hold nothing while a check runs (the full run above passes)."""
    from neuron_app import selftest
    from neuron_app.engine.manager import PipelineManager

    parent = PipelineManager(make_settings(device="neuron-emulated"))  # what the old run() held: all 4 cores
    got = selftest.worker(["image", "neuron-emulated", "tiny", "64x64", str(tmp_path / "restart")])
    assert parent.backend.cores == [0, 1, 2, 3]
    assert "NeuronCore 0 of the emulated trn2.3xlarge is held by process" in got.get("error", ""), got
    assert f"held by process {os.getpid()} (NEURON_RT_VISIBLE_CORES=0)" in got["error"], got


def test_the_core_check_says_in_one_line_each_what_the_emulators_rules_do(tmp_path: Path) -> None:
    """Issue 56's device check, on the emulator: two cores in one process (a child of its own), a direct core-to-core
    copy refused with TorchNeuron's text, a compiled graph run on the current device (so refused with its inputs on
    another core). On a trn2 the same two lines say what TorchNeuron 2.34 does."""
    from neuron_app.selftest import check_cores

    copy, graph = check_cores("neuron-emulated", tmp_path)
    assert copy.check == "core-to-core copy" and copy.verdict == "pass", copy
    assert "refused (NeuronRuleViolation: neuron rule: Device-to-device copy requires tensors on same" in copy.found
    assert graph.check == "compiled graph runs on" and graph.found.startswith("the current device: "), graph


@pytest.mark.slow
def test_the_tp_check_runs_the_compiled_sharded_path_on_free_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """U2 and U9: the TP check runs the guide's TP set-up with the compiled sharded transformer
    (examples/guide_tp_compiled.py), 2 ranks against 1, beside a process that holds core 0 (a server): its ranks
    take free cores from the emulator's registry, each holding half of every sharded weight."""
    from neuron_app.backends.emulator import cores
    from neuron_app.scale.tp_check import check_tp

    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0")
    assert cores.acquire() == [0]  # held by this process until it exits: the "server"
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES")
    verdict, found = check_tp("neuron-emulated", "tiny", tmp_path)
    assert verdict == "pass", found
    assert found.startswith("compiled sharded transformer, 64 px, 1 rank ") and "(core 1)" in found, found
    assert "(cores 1, 2)" in found and "each rank's share of the sharded weights: 0.50, 0.50" in found, found
    # The one run of the compiled TP path in the suite (the selftest's full run skips it, test_emulate runs the eager
    # guide): what test_emulate checked of it too, from each rank's log. Each rank traces its shard's graph (4
    # attention calls in tiny-shapes' transformer), 0 violations, on its own device index.
    for rank in (0, 1):
        out, err = (tmp_path / f"rank{rank}-of-2.{kind}" for kind in ("out", "err"))
        assert f"rank {rank}: compiled sharded transformer on neuron:{rank}, image made" in out.read_text()
        assert "graph 0: 4 attention call(s)" in err.read_text() and "violations 0" in err.read_text()
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "3")  # one core given: too few for 2 ranks, said so
    assert check_tp("neuron-emulated", "tiny", tmp_path) == (
        "skip",
        "TP=2 needs 2 NeuronCores; NEURON_RT_VISIBLE_CORES=3 gives 1",
    )
