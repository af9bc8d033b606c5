"""The plan as the app reads it: `doctor`'s check, the page's plan line, and `placement = "auto"`'s choice.

Each runs `plan` for the served model's configured shapes, TP and placement. The page and `auto` run it in a process
of its own (`python -m neuron_app plan --json`): the measurement sets torch's process-wide default dtype and holds
the CPU for seconds, neither of which a serving process should share.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from neuron_app.engine.model.real.catalog import ALIASES


def planned(model: str) -> str | None:
    """The spec the plan measures for `model`; None for a model it does not know (a tiny model, a folder)."""
    return next((v for k, v in ALIASES.items() if k.lower() == model.strip().lower()), None)


def words(r: dict[str, Any]) -> str:
    """One planned shape: "1024x1024: fits, 14.8 of 24 GiB per core (together), floor 0.92 s per image"."""
    refs = f" with {r['references']} reference(s)" if r.get("references") else ""
    return (
        f"{r['shape']}{refs}: {'fits' if r['fits'] else 'does NOT fit'}, {r['total_gib_per_core']:.1f} of "
        f"{r['hbm_gib_per_core']:g} GiB per core ({r['placement']['setting']}), floor {r['floor_s_per_image']:.2f} s "
        "per image"
    )


def rows_here(model: str, resolutions: list[str], tp: int, family: str, setting: str = "auto") -> list[dict[str, Any]]:
    """The plan's rows, measured in this process (`doctor`, which serves nothing)."""
    from neuron_app.engine.model.real.catalog import instance
    from neuron_app.engine.model.real.fit import plan_one
    from neuron_app.shapes import Resolution

    spec = planned(model)
    if spec is None:
        return []
    inst = instance(family)
    return [
        plan_one(spec, model, Resolution.parse(shape), tp, inst, 0, inst.default_instance_type, None, setting)
        for shape in resolutions
    ]


def served(model: str, resolutions: list[str], tp: int, family: str, setting: str = "auto") -> dict[str, Any] | None:
    """What the served model needs per core at each configured shape, TP and placement on this instance family,
    before any compile. `fits`; `words`; `would`: the placement setting that fits every shape when the configured
    one does not (None when none does at this TP). None when the plan does not know the model."""
    if planned(model) is None:
        return None
    rows = rows_here(model, resolutions, tp, family, setting)
    fits = all(r["fits"] for r in rows)
    text = f"{model} on {family} at TP {tp}: " + "; ".join(words(r) for r in rows)
    would = None
    if not fits:
        best = rows_here(model, resolutions, tp, family, "auto") if setting != "auto" else rows
        if all(r["fits"] for r in best):
            would = _widest(best)
    return {"fits": fits, "words": text, "would": would}


def _widest(rows: list[dict[str, Any]]) -> str:
    """Of the placements `auto` chose per shape, the one with the most cores: it fits every shape."""
    from neuron_app.engine.model.real.layout import SETTINGS

    return max((r["placement"]["setting"] for r in rows), key=SETTINGS.index)


def run_plan(
    model: str,
    resolutions: list[str],
    tp: int,
    family: str = "trn2",
    setting: str = "auto",
    hbm_gib: float | None = None,
) -> list[dict[str, Any]]:
    """`python -m neuron_app plan ... --json` in a process of its own (see the module's docstring)."""
    command = [sys.executable, "-m", "neuron_app", "plan", "--model", model, "--tp", str(tp), "--instance", family]
    command += [word for shape in resolutions for word in ("--shape", shape)] + ["--placement", setting, "--json"]
    if hbm_gib is not None:
        command += ["--hbm-gib", f"{hbm_gib:g}"]
    return json.loads(_child(command))


def _child(command: list[str]) -> str:
    """The plan's stdout, from a child whose torch does not autoload the Neuron backend: a planning process never
    asks the runtime for the cores its parent may hold (the seventh review's V8); the plan needs no device."""
    import os

    root = Path(__file__).resolve().parents[4]  # where `neuron_app` imports from, whatever the cwd
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=True, cwd=root, env=env)
    return done.stdout


def run_best(
    model: str,
    resolutions: list[str],
    cores: list[int],
    goal: str,
    tp: int | None,
    hbm_gib: float | None,
    setting: str = "auto",
    family: str = "trn2",
) -> dict[str, Any]:
    """`python -m neuron_app plan --best --json` for these cores, in a child (`_child`): the topology's fields."""
    command = [sys.executable, "-m", "neuron_app", "plan", "--best", "--json", "--model", model, "--instance", family]
    command += [word for shape in resolutions for word in ("--shape", shape)] + ["--placement", setting]
    command += ["--cores", f"{cores[0]}-{cores[-1]}", "--goal", goal] + (["--tp", str(tp)] if tp else [])
    if hbm_gib is not None:
        command += ["--hbm-gib", f"{hbm_gib:g}"]
    try:
        return json.loads(_child(command))["topology"]
    except subprocess.CalledProcessError as exc:  # a bad setting the plan refuses: its own line
        lines = (exc.stderr or "").strip().splitlines()
        from neuron_app.errors import SettingsError

        raise SettingsError(f"the plan refused the topology: {lines[-1] if lines else exc}") from None


def choose(model: str, resolutions: list[str], family: str, hbm_gib: float | None, most_cores: int) -> str:
    """`placement = "auto"`: the first placement the plan finds that fits every configured shape in a core of
    `hbm_gib` (None: the instance's own) and needs at most the `most_cores` the process holds; `together` for a
    model the plan does not know, and when none fits (the load then fails with the device's out-of-memory)."""
    from neuron_app.engine.model.real.layout import LAYOUTS

    if planned(model) is None:
        return "together"
    rows = run_plan(model, resolutions, 1, family, "auto", hbm_gib)
    if not all(r["fits"] for r in rows):
        return "together"
    choice = _widest(rows)
    cores = next(item.cores for item in LAYOUTS if item.setting == choice)
    return choice if cores <= most_cores else "together"


class PlanLine:
    """The page's status line of `plan` for the served model (trn2, the configured shapes, TP and placement):
    measured once, on a thread of its own, never on a status read; None until then, and for a model the plan does
    not know."""

    def __init__(self, model: str, resolutions: list[str], tp: int, setting: str = "auto") -> None:
        self._text: str | None = None
        self._args = (model, resolutions, tp, setting)
        self._started = threading.Event()
        self.done = threading.Event()  # measured (or given up): the status carries the line from now on
        self.planned = planned(model) is not None

    def text(self) -> str | None:
        if self.planned and not self._started.is_set():
            self._started.set()
            threading.Thread(target=self._measure, name="plan-line", daemon=True).start()
        return self._text

    def _measure(self) -> None:
        model, resolutions, tp, setting = self._args
        try:
            self._text = "; ".join(words(r) for r in run_plan(model, resolutions, tp, "trn2", setting))
        except (OSError, ValueError, subprocess.SubprocessError) as exc:  # a status line, never a server failure
            self._text = f"not measured ({type(exc).__name__})"
        finally:
            self.done.set()
