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


# --- what the stand-in computes as the TensorEngine does ----------------------------------------------------------
def accumulate_in_float32(op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A convolution of bfloat16 (or float16) operands, computed as a NeuronCore's TensorEngine does: the products
    summed in float32, the result rounded once to the operands' dtype. On a CPU without bfloat16 instructions
    (no AVX-512 BF16, no AMX) torch's own bfloat16 convolution takes its reference loop: measured here, one
    256-channel 128x128 3x3 convolution took 82 s against 0.33 s in float32, and klein-4B's VAE tile timed CI out.
    On a CPU with them, oneDNN sums in float32 too: the same numbers on every host."""
    import torch

    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    low = next((t.dtype for t in tensors if t.dtype in (torch.bfloat16, torch.float16)), None)
    if low is None:
        return op(*args, **kwargs)

    def wide(a: Any) -> Any:  # `bias=` too, as a script may pass it
        return a.float() if isinstance(a, torch.Tensor) and a.dtype == low else a

    return op(*map(wide, args), **{k: wide(v) for k, v in kwargs.items()}).to(low)


def convolutions() -> frozenset[Any]:
    """The convolution callables a dynamo graph or an eager dispatch names."""
    import torch
    import torch.nn.functional as F

    ops = [torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d, torch.conv_transpose2d]
    ops += [F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, torch.ops.aten.convolution.default]
    return frozenset(ops)


_ROUTED: dict[Any, Callable[..., Any]] = {}


def _routed(op: Any) -> Callable[..., Any]:
    """`op` through `accumulate_in_float32`, as a named function a graph's code can call."""
    if op not in _ROUTED:

        def routed(*args: Any, **kwargs: Any) -> Any:
            return accumulate_in_float32(op, *args, **kwargs)

        name = getattr(op, "__name__", "convolution").replace(".", "_")
        routed.__name__ = routed.__qualname__ = f"accumulate_in_float32_{name}"
        _ROUTED[op] = routed
    return _ROUTED[op]


def lower_convolutions(gm: Any) -> int:
    """Route a graph's convolutions through `accumulate_in_float32` before the stand-in compiles it (in place, after
    its NEFF key is taken: the key is the graph the script made). Returns how many were routed."""
    targets = convolutions()
    routed = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in targets:
            node.target = _routed(node.target)
            routed += 1
    if routed:
        gm.recompile()
    return routed
