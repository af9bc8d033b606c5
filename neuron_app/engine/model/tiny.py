"""A tiny random FLUX.2-klein built offline from the real diffusers/transformers classes.

It is saved once with `save_pretrained` and then loaded through the same `from_pretrained`
path as the real model, so tests and the no-hardware demo exercise the real loading,
compile and generation code. Random weights: the images are noise, the mechanics are real.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: Bump when the recipe changes so that older saved copies are rebuilt.
RECIPE_VERSION = 1

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


@dataclass(frozen=True)
class TinyRecipe:
    """Sizes of a tiny model; the block counts can match the real 4B (5 double, 20 single)."""

    double_blocks: int = 1
    single_blocks: int = 1
    heads: int = 2
    head_dim: int = 16
    text_hidden: int = 16
    text_layers: int = 27  # the pipeline reads hidden states (9, 18, 27)
    vae_channels: int = 4
    seed: int = 0
    #: tiny-shapes (trained): a wider VAE with more latent channels, and whole words as tokens.
    latent_channels: int = 1
    vae_widths: tuple[int, ...] = ()  # per level; empty: vae_channels at each of 4 levels
    vae_groups: int = 1
    word_tokens: bool = False

    @property
    def folder_name(self) -> str:
        return f"tiny-flux2-klein-d{self.double_blocks}-s{self.single_blocks}-v{RECIPE_VERSION}"


#: Names accepted by the `model` setting.
VARIANTS: dict[str, TinyRecipe] = {
    "tiny": TinyRecipe(),
    # The real 4B's block structure at tiny width: makes compile-time comparisons meaningful.
    "tiny-deep": TinyRecipe(double_blocks=5, single_blocks=20),
}

#: What `python -m neuron_app train-tiny` starts from: the real classes at a width that learns the shapes world on
#: a CPU in minutes (the trained weights ship in neuron_app/models/tiny-shapes).
SHAPES_RECIPE = TinyRecipe(
    double_blocks=2,
    single_blocks=2,
    heads=4,
    head_dim=32,
    text_hidden=32,
    latent_channels=4,
    vae_widths=(16, 32, 64, 64),
    vae_groups=4,
    word_tokens=True,
)


def _byte_vocab() -> dict[str, int]:
    """The 256 byte-level BPE symbols (GPT-2's byte-to-unicode table)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    symbols = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return {symbols[b]: b for b in range(256)}


def build_tokenizer(word_tokens: bool = False) -> Any:
    """The byte-level BPE tokenizer with Qwen's special tokens; with `word_tokens`, merges that keep each word of
    the shapes world one token (a prompt of the grammar is about 20 tokens with the chat template, not 80)."""
    from transformers import Qwen2Tokenizer

    vocab = _byte_vocab()
    merges: list[tuple[str, str]] = []
    if word_tokens:
        from neuron_app.engine.model.shapes_world import WORDS

        seen: set[tuple[str, str]] = set()
        # Words after a space first (their merges start with the space symbol), then at the start of the text.
        for word in [f"\u0120{w}" for w in WORDS] + list(WORDS) + ["\u010a\u010a"]:
            current = word[0]
            for symbol in word[1:]:
                if (current, symbol) not in seen:
                    seen.add((current, symbol))
                    merges.append((current, symbol))
                current += symbol
                vocab.setdefault(current, len(vocab))
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_pipeline(recipe: TinyRecipe) -> Any:
    """The untrained pipeline of a recipe, in memory."""
    import torch
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(recipe.seed)
    tokenizer = build_tokenizer(recipe.word_tokens)

    text_encoder = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=recipe.text_hidden,
            intermediate_size=2 * recipe.text_hidden,
            num_hidden_layers=recipe.text_layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        )
    )
    latent_channels = recipe.latent_channels
    vae = AutoencoderKLFlux2(
        block_out_channels=recipe.vae_widths or (recipe.vae_channels,) * 4,  # 4 levels: scale factor 8, like the real
        latent_channels=latent_channels,
        norm_num_groups=recipe.vae_groups,
        layers_per_block=1,
        sample_size=64,
    )
    rope_axis = recipe.head_dim // 4
    transformer = Flux2Transformer2DModel(
        in_channels=4 * latent_channels,
        num_layers=recipe.double_blocks,
        num_single_layers=recipe.single_blocks,
        attention_head_dim=recipe.head_dim,
        num_attention_heads=recipe.heads,
        joint_attention_dim=3 * recipe.text_hidden,
        timestep_guidance_channels=32,
        axes_dims_rope=(rope_axis,) * 4,
        guidance_embeds=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return Flux2KleinPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=True,
    )


def write_staged(folder: Path, write: Callable[[Path], None]) -> None:
    """`write(staging)` into a temporary folder beside `folder`, then renamed to it: a crash leaves no half model,
    and of two processes building at once one wins the rename and the other keeps its result."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        write(staging)
        staging.rename(folder)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / "model_index.json").is_file():  # another process did not win the race either
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def build_tiny(folder: Path, recipe: TinyRecipe) -> None:
    """Build and save the pipeline into `folder` (written to a temp folder, then renamed)."""
    pipe = build_pipeline(recipe)

    def write(staging: Path) -> None:
        pipe.save_pretrained(staging)
        (staging / "tiny_recipe.json").write_text(json.dumps(asdict(recipe) | {"version": RECIPE_VERSION}))

    write_staged(folder, write)


def ensure_tiny(models_dir: Path, variant: str = "tiny") -> Path:
    """The saved folder of a tiny variant, built on first use."""
    recipe = VARIANTS[variant]
    folder = models_dir / recipe.folder_name
    if not (folder / "model_index.json").is_file():
        log.info("building tiny model %s in %s", variant, folder)
        build_tiny(folder, recipe)
    return folder
