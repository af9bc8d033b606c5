"""The text encoder stops at the last layer klein reads: the embeddings are bit-for-bit the same."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")


def tiny_folder(models: Path) -> Path:
    """The tiny FLUX.2-klein's folder (the models folder also holds other tests' models, such as the safety one)."""
    from neuron_app.engine.model.tiny import ensure_tiny

    return ensure_tiny(models, "tiny")


def _encoder(layers: int, tie: bool = True) -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(3)
    config = Qwen3Config(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
    )
    return Qwen3ForCausalLM(config).eval()


def _embeds(pipe_class: Any, encoder: Any, tokenizer: Any, prompt: str) -> Any:
    with torch.inference_mode():
        return pipe_class._get_qwen3_prompt_embeds(encoder, tokenizer, prompt, max_sequence_length=32)


@pytest.mark.parametrize("tie", [True, False])
def test_truncated_encoder_gives_identical_embeddings_with_fewer_layers(shared_models: Path, tie: bool) -> None:
    """A 36-layer encoder (Qwen3-4B's depth) read at (9, 18, 27): 27 layers stay, the norm and lm_head go."""
    from diffusers import Flux2KleinInpaintPipeline, Flux2KleinPipeline
    from transformers import AutoTokenizer

    from neuron_app.engine.model.text_encoder import out_layers, truncate_text_encoder

    tokenizer = AutoTokenizer.from_pretrained(tiny_folder(shared_models) / "tokenizer")
    full = _encoder(36, tie)
    short = copy.deepcopy(full)
    read = out_layers(Flux2KleinPipeline.__new__(Flux2KleinPipeline))
    assert read == (9, 18, 27) == out_layers(Flux2KleinInpaintPipeline.__new__(Flux2KleinInpaintPipeline))
    result = truncate_text_encoder(short, read)
    assert (result.layers_before, result.layers_after, len(short.model.layers)) == (36, 27, 27)
    assert result.params_after < result.params_before
    assert isinstance(short.model.norm, torch.nn.Identity) and isinstance(short.lm_head, torch.nn.Identity)
    calls: list[int] = []
    for layer in short.model.layers:
        layer.register_forward_hook(lambda *_: calls.append(1))
    for prompt in ("a lighthouse at dusk", "x"):
        before = _embeds(Flux2KleinPipeline, full, tokenizer, prompt)
        after = _embeds(Flux2KleinPipeline, short, tokenizer, prompt)
        assert before.shape == after.shape and torch.equal(before, after)
    assert len(calls) == 2 * 27  # the cut layers never ran


def test_reading_the_last_layer_keeps_the_norm(shared_models: Path) -> None:
    """The tiny model has exactly 27 layers: hidden_states[27] is the normed last state, so nothing is cut but the
    logits, and the pipeline's embeddings are unchanged."""
    from diffusers import Flux2KleinPipeline

    from neuron_app.engine.model.text_encoder import truncate_pipeline_encoder

    pipe = Flux2KleinPipeline.from_pretrained(tiny_folder(shared_models))
    before = _embeds(Flux2KleinPipeline, pipe.text_encoder, pipe.tokenizer, "a fox")
    result = truncate_pipeline_encoder(pipe)
    assert result is not None and (result.layers_before, result.layers_after) == (27, 27) and result.lm_head_dropped
    assert not isinstance(pipe.text_encoder.model.norm, torch.nn.Identity)
    assert torch.equal(before, _embeds(Flux2KleinPipeline, pipe.text_encoder, pipe.tokenizer, "a fox"))


def test_an_index_past_the_last_layer_is_refused() -> None:
    from neuron_app.engine.model.text_encoder import truncate_text_encoder

    with pytest.raises(ValueError, match="reads hidden state 27 but the text encoder has 20 layers"):
        truncate_text_encoder(_encoder(20), (9, 18, 27))
