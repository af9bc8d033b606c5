"""The stand-in for neuronx-cc: a CPU torch.compile backend, and its failures named as its own (U8b).

No Neuron compiler runs here: a graph that passes the emulator's rules is compiled by a CPU backend (`aot_eager`
by default, `NEURON_EMULATOR_COMPILER` picks another: `eager`, `inductor`). That backend can fail where neuronx-cc
would not: `torch.compile(pipe.vae.decode, backend="neuron", fullgraph=True, dynamic=False)` stops in aot_eager's
functionalized graph with `Expected X.is_contiguous(memory_format)`, exactly as on plain CPU with
`backend="aot_eager"`, and passes with `eager`. Such a failure must not read as the user's bug nor as a Neuron rule:
`StandInCompilerFailed` says whose it is, shows the CPU error, and says whether the same call passes eagerly.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from neuron_app.errors import AppError, NeuronRuleViolation, one_line

#: The CPU backend standing in for neuronx-cc under `python -m neuron_app emulate`.
STAND_IN_VAR = "NEURON_EMULATOR_COMPILER"
DEFAULT_STAND_IN = "aot_eager"


class StandInCompilerFailed(AppError, RuntimeError):
    """The emulator's CPU compiler failed on a graph: the emulator's limit, not a Neuron rule nor (where the same
    call passes eagerly) the script's bug."""


def stand_in() -> str:
    """The CPU backend compiling device graphs now (read at each compile, as the user may change it)."""
    return os.environ.get(STAND_IN_VAR, "").strip() or DEFAULT_STAND_IN


def _chain(exc: BaseException) -> list[BaseException]:
    seen, found, current = set(), [], exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        found.append(current)
        current = getattr(current, "inner_exception", None) or current.__cause__
    return found


def is_stand_in_failure(exc: BaseException) -> bool:
    """Raised by the stand-in compiler (its compile, or the graph it made): not a rule of ours, not dynamo's own
    tracing of the script (graph breaks, fake-tensor shape errors: the same on a device, whose compile is dynamo's
    too), not the fork rule."""
    import torch._dynamo.exc as dynamo_exc

    chain = _chain(exc)
    if any(isinstance(e, (NeuronRuleViolation, AppError)) for e in chain):
        return False
    if isinstance(exc, dynamo_exc.BackendCompilerFailed):
        return True
    return not isinstance(exc, dynamo_exc.TorchDynamoException)


def passes_eagerly(fn: Callable[..., Any], args: tuple, kwargs: dict) -> bool:
    """The same call without compiling (torch's `force_eager` stance): does the script's code itself run?"""
    import torch

    try:
        with torch.compiler.set_stance("force_eager"):
            fn(*args, **kwargs)
    except Exception:
        return False
    return True


def named_failure(exc: BaseException, fn: Callable[..., Any], args: tuple, kwargs: dict, graph: str) -> BaseException:
    """`exc` itself when it is not the stand-in's (or the script fails eagerly too: its own bug), else a
    `StandInCompilerFailed` that says so."""
    if not is_stand_in_failure(exc):
        return exc
    import torch._dynamo.exc as dynamo_exc

    eager = passes_eagerly(fn, args, kwargs)
    at_compile = isinstance(exc, dynamo_exc.BackendCompilerFailed)
    if not eager and not at_compile:
        return exc  # the script's own code fails without compiling too: its error, unchanged
    name = stand_in()
    verdict = (
        f"the same call passes with the `eager` stand-in (run without compiling); {STAND_IN_VAR}=eager (dynamo's "
        "graph run as traced, no AOT compile) lets the rest of the script run"
        if eager
        else "the same call fails without compiling too"
    )
    return StandInCompilerFailed(
        f"the emulator's CPU compiler ({name}, standing in for neuronx-cc) failed on the compiled device graph "
        f"{graph}: {one_line(exc)}. This is not a Neuron rule and says nothing about the device: {verdict}"
    )
