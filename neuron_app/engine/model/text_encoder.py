"""The text encoder stops at the last layer klein reads.

FLUX.2-klein takes the Qwen3 encoder's hidden states at `text_encoder_out_layers` ((9, 18, 27) in both klein
pipelines) and nothing else: not the later layers, not the final norm, not the logits. Qwen3-4B has 36 layers,
so a quarter of its layers and its 151k-word `lm_head` (the cost of about four layers on 512 tokens) ran for
nothing on every prompt, and on Neuron their weights sat in device memory. After loading, the layers after the
last one read are dropped, the final norm becomes an identity (hidden_states[k] for k < number of layers is a
layer's raw output: the norm only ever touched the last entry, which klein did not read) and `lm_head` an
identity. The hidden states klein reads are bit-for-bit those of the full encoder
(tests/engine/model/test_text_encoder.py).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: What both klein pipelines default to, if a pipeline class does not say.
DEFAULT_OUT_LAYERS = (9, 18, 27)


@dataclass(frozen=True)
class Truncation:
    """What `truncate_text_encoder` did: layers before and after, parameters dropped."""

    layers_before: int
    layers_after: int
    params_before: int
    params_after: int
    lm_head_dropped: bool

    @property
    def changed(self) -> bool:
        return self.layers_after < self.layers_before or self.lm_head_dropped


def out_layers(pipe: Any) -> tuple[int, ...]:
    """The hidden-state indices the pipeline reads: the default of its `text_encoder_out_layers`."""
    for name in ("encode_prompt", "__call__"):
        param = inspect.signature(getattr(type(pipe), name)).parameters.get("text_encoder_out_layers")
        if param is not None and param.default is not inspect.Parameter.empty:
            return tuple(int(i) for i in param.default)
    return DEFAULT_OUT_LAYERS


def _param_count(module: Any) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def truncate_text_encoder(encoder: Any, read: tuple[int, ...]) -> Truncation:
    """Cut a Qwen3ForCausalLM after hidden_states[max(read)] (index 0 is the embeddings, i the i-th layer's output).

    Negative indices (counted from the end) would read the normed last state: then nothing is cut."""
    import torch

    decoder = encoder.model
    layers = len(decoder.layers)
    before = _param_count(encoder)
    keep = max(read) if read and min(read) >= 0 else layers
    if keep > layers:
        raise ValueError(f"the pipeline reads hidden state {keep} but the text encoder has {layers} layers")
    if keep < layers:
        # hidden_states[keep] was layer `keep`'s raw output; once it is the last entry, transformers replaces it
        # with norm(last): the norm must become an identity for that entry to stay the raw output.
        decoder.layers = torch.nn.ModuleList(list(decoder.layers)[:keep])
        decoder.norm = torch.nn.Identity()
        decoder.config.num_hidden_layers = keep
        if getattr(decoder.config, "layer_types", None):
            decoder.config.layer_types = list(decoder.config.layer_types)[:keep]
    dropped_head = not isinstance(getattr(encoder, "lm_head", None), torch.nn.Identity)
    if dropped_head:
        encoder.lm_head = torch.nn.Identity()  # logits nobody reads: a vocabulary-wide matmul per token
    result = Truncation(layers, keep, before, _param_count(encoder), dropped_head)
    log.info(
        "text encoder: %d of %d layers kept (hidden states %s read), lm_head dropped; %.1fM -> %.1fM parameters",
        keep,
        layers,
        list(read),
        before / 1e6,
        result.params_after / 1e6,
    )
    return result


def truncate_pipeline_encoder(pipe: Any) -> Truncation | None:
    """Truncate `pipe.text_encoder` to what `pipe` reads; None when the pipeline has no Qwen3-style encoder."""
    encoder = getattr(pipe, "text_encoder", None)
    if encoder is None or not hasattr(getattr(encoder, "model", None), "layers"):
        return None
    return truncate_text_encoder(encoder, out_layers(pipe))
