"""What ran on the CPU instead of the device, per shape (second review, N8/N9).

`torch_neuronx.get_fallback_ops()` is process-wide and lists op invocations, so a shape's own fallbacks are
the ops whose count grew during its warm-up, each named once. Some fallbacks are known-cheap host glue rather
than a slow path: diffusers' latent unpack (`aten::scatter_.src`, which a third-party Trn2 measurement found
has no Neuron kernel) is one small host round trip per decode. Those are listed, but do not mark a shape
`degraded`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

#: Fallbacks that cost one small host round trip per request, not a slow path.
HOST_GLUE = frozenset({"scatter_.src"})


def op_name(op: str) -> str:
    """`aten::scatter_.src`, `aten.scatter_.src` and `scatter_.src` are one op."""
    name = op.split(" (")[0]
    for prefix in ("aten::", "aten."):
        name = name.removeprefix(prefix)
    return name


def new_fallbacks(before: Iterable[str], after: Iterable[str]) -> list[str]:
    """The ops that ran on the CPU between two `get_fallback_ops()` readings, each once."""
    grown = Counter(after) - Counter(before)
    return sorted(grown)


def is_host_glue(op: str) -> bool:
    """`scatter_.src` in any spelling, and `aten::scatter_` without an overload (T9: the only name TorchNeuron's
    tests show, `aten::_test_serialization_subcmul`, has none, so its list may name ops without one); another
    overload named (`scatter_.value`) is not the glue."""
    name = op_name(op)
    return name in HOST_GLUE or ("." not in name and name in {glue.split(".")[0] for glue in HOST_GLUE})


def degrading(ops: Iterable[str]) -> list[str]:
    """The fallbacks that make a shape `degraded`: all but the host glue."""
    return [op for op in ops if not is_host_glue(op)]
