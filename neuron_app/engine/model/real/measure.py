"""Measured, not estimated: the real diffusers/transformers modules built and run under torch's FakeTensorMode.

A fake tensor has a shape, a dtype and a (meta) storage of the real size but no data, so building klein-9B and
running its forward at 1024x1024 costs a second and no memory. What is read off that run:
- parameters: counted on the instantiated modules (the text encoder after the cut klein reads, text_encoder.py);
- weights per core: the bytes of the parameters and buffers one core holds, in bfloat16. For the transformer at TP N
  that is the shard diffusers' own TP plan gives a rank (`_tp_plan` through `resolve_tp_shard_specs`): the sharded
  Linear weights divided by N, rowwise biases, norms, embedders and modulation replicated;
- FLOPs: torch.utils.flop_counter.FlopCounterMode over one call (matmuls, convolutions and attention, as it counts;
  elementwise work is not counted). The transformer at TP N runs as one rank: its sharded Linears get the local
  weight shapes, the processors split heads by the local width (they are TP-agnostic), and a rowwise output is the
  rank's partial sum, of the full shape, as before the all-reduce;
- peak live activations: a dispatch mode that records the storage of every tensor an op returns (by storage, so views
  count once) and drops it when the storage dies, and keeps the largest sum seen. Parameters and buffers are
  excluded; the call's inputs are included. Attention is torch's fused CPU kernel, which, like a device's
  flash-attention kernel, never holds the full attention matrix.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any

from neuron_app.engine.model.real.catalog import component_config, load_spec
from neuron_app.engine.model.text_encoder import truncate_text_encoder


@dataclass(frozen=True)
class Measured:
    """One component's call on one core."""

    params: int  # the whole component's parameters (not the shard)
    weight_bytes: int  # what one core holds: its shard's parameters and buffers
    flops: int  # one call on one core
    activation_bytes: int  # peak live activation storage during that call on one core


@cache
def _mode() -> Any:
    """One fake-tensor mode for the process: modules built under it are run under it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


#: One measurement at a time in a process: the fake mode is made once, and the default dtype is process-wide (two
#: threads measuring at once made two modes, and "Mixing fake modes" failed the second).
_MEASURING = threading.RLock()


@contextmanager
def _fake(dtype_name: str = "bfloat16"):
    """Inside the fake mode, with `dtype_name` as the default dtype (what the weights are built in), restored after."""
    import torch

    with _MEASURING:
        before = torch.get_default_dtype()
        torch.set_default_dtype(getattr(torch, dtype_name))
        try:
            with _mode(), torch.no_grad():
                yield
        finally:
            torch.set_default_dtype(before)


def _storage_key(tensor: Any) -> tuple[Any, int]:
    from torch.multiprocessing.reductions import StorageWeakRef

    storage = tensor.untyped_storage()
    return StorageWeakRef(storage), storage.nbytes()


class _LiveStorages:
    """Peak bytes of the storages alive during a call, from every op's outputs (a TorchDispatchMode when entered)."""

    def __init__(self, exclude: Iterable[Any]) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        self.exclude = {_storage_key(t)[0].cdata for t in exclude}
        self.live: dict[int, tuple[Any, int]] = {}
        self.peak = 0
        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                tracker.add(out)
                return out

        self.mode = Mode()

    def add(self, value: Any) -> None:
        import torch
        from torch.utils._pytree import tree_flatten

        for tensor in tree_flatten(value)[0]:
            if isinstance(tensor, torch.Tensor):
                ref, nbytes = _storage_key(tensor)
                if ref.cdata not in self.exclude:
                    self.live.setdefault(ref.cdata, (ref, nbytes))
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[key]
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))


def _attention_flops(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """QK^T and the weighted sum of V for torch's CPU flash kernel, which FlopCounterMode does not know; grouped
    query attention (fewer key heads) costs the same per query head."""
    batch, heads, queries, dim = query
    return 2 * batch * heads * queries * key[-2] * (dim + value[-1])


def _run(module: Any, call: Callable[[], Any], inputs: list[Any]) -> tuple[int, int]:
    """(FLOPs, peak live activation bytes) of `call()` on `module`, inside the fake mode."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    tracker = _LiveStorages([*module.parameters(), *module.buffers()])
    tracker.add(inputs)
    counter = FlopCounterMode(
        display=False, custom_mapping={torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops}
    )
    with counter, tracker.mode:
        call()
    return counter.get_total_flops(), tracker.peak


def _bytes(module: Any) -> int:
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.untyped_storage().nbytes() for t in tensors.values())


def _params(module: Any) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


@cache
def _transformer(spec: str, tp: int) -> tuple[Any, int]:
    """The transformer as one rank of TP `tp` holds it, and the whole model's parameter count."""
    import torch
    from diffusers import Flux2Transformer2DModel
    from diffusers.hooks.tensor_parallel import resolve_tp_shard_specs

    with _fake():
        model = Flux2Transformer2DModel(**component_config(load_spec(spec), "transformer")).eval()
        params = _params(model)
        if tp > 1:
            for name, shard in resolve_tp_shard_specs(model, model._tp_plan, tp).items():
                if shard.dim is None:
                    continue
                owner, _, leaf = name.rpartition(".")
                full = getattr(model.get_submodule(owner), leaf)
                shape = list(full.shape)
                shape[shard.dim] //= tp
                local = torch.nn.Parameter(torch.empty(shape, dtype=full.dtype), requires_grad=False)
                setattr(model.get_submodule(owner), leaf, local)
    return model, params


@cache
def transformer(spec: str, width: int, height: int, tp: int, text_tokens: int, references: int = 0) -> Measured:
    """One denoising step (one transformer forward) on one rank of TP `tp`. An edit's `references` (each of the
    image's area) join the image tokens: klein attends over the image, the references and the prompt together."""
    import torch

    model, params = _transformer(spec, tp)
    config = model.config
    tokens = (width // 16) * (height // 16) * (1 + references)
    with _fake():
        inputs = [
            torch.empty(1, tokens, config.in_channels),
            torch.empty(1, text_tokens, config.joint_attention_dim),
            torch.empty(1),
            torch.zeros(1, tokens, 4, dtype=torch.long),
            torch.zeros(1, text_tokens, 4, dtype=torch.long),
        ]
        flops, peak = _run(
            model,
            lambda: model(
                hidden_states=inputs[0],
                encoder_hidden_states=inputs[1],
                timestep=inputs[2],
                img_ids=inputs[3],
                txt_ids=inputs[4],
                return_dict=False,
            ),
            inputs,
        )
    return Measured(params, _bytes(model), flops, peak)


@cache
def _text_encoder(spec: str) -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    loaded = load_spec(spec)
    with _fake():
        encoder = Qwen3ForCausalLM(Qwen3Config(**component_config(loaded, "text_encoder"))).eval()
    encoder.config._attn_implementation = "sdpa"
    truncate_text_encoder(encoder, tuple(loaded["pipeline"]["text_encoder_out_layers"]))
    return encoder


@cache
def text_encoder(spec: str, text_tokens: int) -> Measured:
    """One prompt through the cut Qwen3 encoder, every hidden state returned (the pipeline reads three of them)."""
    import torch

    encoder = _text_encoder(spec)
    with _fake():
        inputs = [torch.zeros(1, text_tokens, dtype=torch.long), torch.ones(1, text_tokens, dtype=torch.long)]
        flops, peak = _run(
            encoder,
            lambda: encoder(input_ids=inputs[0], attention_mask=inputs[1], output_hidden_states=True, use_cache=False),
            inputs,
        )
    return Measured(_params(encoder), _bytes(encoder), flops, peak)


@cache
def _vae(spec: str) -> Any:
    from diffusers import AutoencoderKLFlux2

    with _fake():
        return AutoencoderKLFlux2(**component_config(load_spec(spec), "vae")).eval()


@cache
def vae(spec: str, width: int, height: int) -> Measured:
    """One whole-image decode (the pipeline's last call; the tiled decode of engine/model/vae.py holds less)."""
    import torch

    model = _vae(spec)
    with _fake():
        inputs = [torch.empty(1, model.config.latent_channels, height // 8, width // 8)]
        flops, peak = _run(model, lambda: model.decode(inputs[0], return_dict=False), inputs)
    return Measured(_params(model), _bytes(model), flops, peak)


@cache
def vae_encode(spec: str, width: int, height: int) -> Measured:
    """One reference image encoded (an edit encodes each of its references once)."""
    import torch

    model = _vae(spec)
    with _fake():
        inputs = [torch.empty(1, 3, height, width)]
        flops, peak = _run(model, lambda: model.encode(inputs[0], return_dict=False), inputs)
    return Measured(_params(model), _bytes(model), flops, peak)
