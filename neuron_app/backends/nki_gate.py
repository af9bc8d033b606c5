"""TorchNeuron's gate for its NKI flash-attention kernel, evaluated on a traced graph (second review, N1).

TorchNeuron's dynamo backend lowers `scaled_dot_product_attention` to the NKI flash kernel only when the
query length L and key length S are multiples of 512, the head dim D is at most 128, batch x heads is at most
512, key and value have one shape, and there is no mask and no dropout; otherwise it decomposes attention
(a materialised L x S score matrix; a third-party Trn2 measurement found it 6.4x slower). The gate is read
from TorchNeuron's source and that measurement, not from AWS's docs, so the released wheels may differ.
Imports nothing heavy: it reads the FX nodes' example values, whatever the backend.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

#: The gate's constants (TorchNeuron `neuron_dynamo_backend/decompositions.py`, as the second review read it).
SEQ_MULTIPLE = 512
MAX_HEAD_DIM = 128
MAX_BATCH_HEADS = 512


@dataclass(frozen=True)
class Attention:
    """One SDPA call of a graph: its shapes and whether the NKI kernel takes it (and if not, why)."""

    query: tuple[int, ...]
    key: tuple[int, ...]
    nki: bool
    why_not: str = ""


def gate(query: tuple[int, ...], key: tuple[int, ...], value: tuple[int, ...], masked: bool, dropout: float) -> str:
    """Why the NKI kernel would not take this call ("" when it would). Shapes are (B, H, L, D)."""
    if len(query) != 4 or len(key) != 4:
        return f"not 4-d (query {query})"
    (b, h, length, d), source = query, key[2]
    reasons = []
    if masked:
        reasons.append("an attention mask")
    if dropout:
        reasons.append(f"dropout {dropout}")
    if tuple(key) != tuple(value):
        reasons.append(f"key {key} != value {value}")
    if length % SEQ_MULTIPLE:
        reasons.append(f"L={length} not a multiple of {SEQ_MULTIPLE}")
    if source % SEQ_MULTIPLE:
        reasons.append(f"S={source} not a multiple of {SEQ_MULTIPLE}")
    if d > MAX_HEAD_DIM:
        reasons.append(f"D={d} > {MAX_HEAD_DIM}")
    if b * h > MAX_BATCH_HEADS:
        reasons.append(f"B*H={b * h} > {MAX_BATCH_HEADS}")
    return "; ".join(reasons)


#: TorchNeuron's switch for the kernel, read at every SDPA decomposition (its `_getenv_bool(..., True)`), so a
#: value set after start (diffusers' integration test sets it in a fixture) counts from the next compiled graph.
NKI_SDPA_VAR = "TORCH_NEURONX_ENABLE_NKI_SDPA"
NKI_SDPA_OFF = f"{NKI_SDPA_VAR}=0"


def nki_sdpa_enabled() -> bool:
    """The kernel is allowed now: unset or true; `0`, `false`, `no`, `off` turn it off (read at each call)."""
    return os.environ.get(NKI_SDPA_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def _shape(node: Any) -> tuple[int, ...] | None:
    meta = getattr(node, "meta", None) or {}
    val = meta.get("example_value", meta.get("val"))
    shape = getattr(val, "shape", None)
    try:
        return None if shape is None else tuple(int(s) for s in shape)
    except TypeError:  # a symbolic size: dynamic shapes, which the neuron backend refuses anyway
        return None


def attentions(gm: Any) -> list[Attention]:
    """Every `scaled_dot_product_attention` call in an FX graph, judged by the gate (and TorchNeuron's switch, read
    now: with `TORCH_NEURONX_ENABLE_NKI_SDPA=0` none takes the kernel)."""
    enabled = nki_sdpa_enabled()
    found = []
    for node in getattr(getattr(gm, "graph", None), "nodes", []):
        name = getattr(node.target, "__name__", str(node.target))
        if node.op != "call_function" or "scaled_dot_product_attention" not in name:
            continue
        args = list(node.args) + [None] * 5  # positional, or keywords (diffusers passes query=, key=, value=)
        named = ("query", "key", "value", "attn_mask", "dropout_p")
        given = [node.kwargs.get(n, a) for n, a in zip(named, args, strict=False)]
        q, k, v = (_shape(a) for a in given[:3])
        if q is None or k is None or v is None:
            continue
        mask = given[3]
        dropout = given[4] if given[4] is not None else 0.0
        why = gate(q, k, v, mask is not None, float(dropout) if isinstance(dropout, (int, float)) else 1.0)
        why = why if enabled else NKI_SDPA_OFF
        found.append(Attention(q, k, not why, why))
    return found


def summary(found: list[Attention]) -> bool | None:
    """True when every attention call takes the NKI kernel, False when one does not, None when there is none."""
    return None if not found else all(a.nki for a in found)


def tokens_qualify(image_tokens: int, text_tokens: int) -> bool:
    """The joint sequence of FLUX.2's double-stream blocks (image + text) meets the length part of the gate."""
    return (image_tokens + text_tokens) % SEQ_MULTIPLE == 0


#: TorchNeuron's SDPA decomposition calls the NKI kernel inside `try`, and on any exception logs this (at debug) and
#: decomposes attention instead (TN-SRC `neuron_dynamo_backend/decompositions.py`): the gate being met says only
#: that the kernel was tried. Counting these records while a graph compiles on the device is the measurement (T10).
KERNEL_LOGGER = "torch_neuronx.neuron_dynamo_backend.decompositions"
KERNEL_FAILED = "NKI kernel call failed"


class KernelFailures(logging.Filter):
    """Counts TorchNeuron's "NKI kernel call failed" records; passes on only what the logger passed before."""

    def __init__(self, passed_from: int) -> None:
        super().__init__()
        self.count = 0
        self._passed_from = passed_from
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if KERNEL_FAILED in str(record.msg):
            with self._lock:
                self.count += 1
        return record.levelno >= self._passed_from  # its debug lines stay as quiet as they were


def watch_kernel_failures() -> KernelFailures:
    """Install (once per process) the counter on TorchNeuron's decomposition logger, opened to debug records."""
    logger = logging.getLogger(KERNEL_LOGGER)
    for existing in logger.filters:
        if isinstance(existing, KernelFailures):
            return existing
    watch = KernelFailures(logger.getEffectiveLevel())
    logger.addFilter(watch)
    logger.setLevel(logging.DEBUG)
    return watch


def nki_verdict(gate: bool | None, failures_before: int | None, failures_now: int | None) -> tuple[str, bool]:
    """T10, in words: on a device whether attention took the kernel is measured (no kernel call failed while the
    graph compiled), elsewhere the gate only predicts it ("eligible"). True: a failed kernel, worth a warning."""
    if gate is None:
        return "no attention graph", False
    if not nki_sdpa_enabled():  # TorchNeuron never calls the kernel: no failure is logged, none is measured (U4)
        return f"no ({NKI_SDPA_OFF}: attention decomposed, the kernel never called)", False
    if not gate:
        return "no (decomposed attention: the gate is not met)", False
    if failures_now is None or failures_before is None:
        return "eligible (predicted: the gate is met on the traced graph; only a device runs the kernel)", False
    if failures_now > failures_before:
        failed = failures_now - failures_before
        return f"no (measured: the kernel call failed {failed} time(s) and attention was decomposed)", True
    return "yes (measured: no kernel call failed while it compiled)", False
