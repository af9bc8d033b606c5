"""TorchNeuron's gate for its NKI flash-attention kernel, evaluated on a traced graph (second review, N1).

TorchNeuron's dynamo backend lowers `scaled_dot_product_attention` to the NKI flash kernel only when the
query length L and key length S are multiples of 512, the head dim D is at most 128, batch x heads is at most
512, key and value have one shape, and there is no mask and no dropout; otherwise it decomposes attention
(a materialised L x S score matrix; a third-party Trn2 measurement found it 6.4x slower). The gate is read
from TorchNeuron's source and that measurement, not from AWS's docs, so the released wheels may differ.
Imports nothing heavy: it reads the FX nodes' example values, whatever the backend.
"""

from __future__ import annotations

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


def _shape(node: Any) -> tuple[int, ...] | None:
    meta = getattr(node, "meta", None) or {}
    val = meta.get("example_value", meta.get("val"))
    shape = getattr(val, "shape", None)
    try:
        return None if shape is None else tuple(int(s) for s in shape)
    except TypeError:  # a symbolic size: dynamic shapes, which the neuron backend refuses anyway
        return None


def attentions(gm: Any) -> list[Attention]:
    """Every `scaled_dot_product_attention` call in an FX graph, judged by the gate."""
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
        found.append(Attention(q, k, not why, why))
    return found


def summary(found: list[Attention]) -> bool | None:
    """True when every attention call takes the NKI kernel, False when one does not, None when there is none."""
    return None if not found else all(a.nki for a in found)


def tokens_qualify(image_tokens: int, text_tokens: int) -> bool:
    """The joint sequence of FLUX.2's double-stream blocks (image + text) meets the length part of the gate."""
    return (image_tokens + text_tokens) % SEQ_MULTIPLE == 0
