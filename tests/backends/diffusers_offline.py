"""A pytest plugin (`-p tests.backends.diffusers_offline`) that runs diffusers' klein pipeline tests offline.

Those tests read two things from the Hub, which this machine cannot reach: the tiny Qwen tokenizer
`hf-internal-testing/tiny-random-Qwen2VLForConditionalGeneration` (the fast tests) and
`black-forest-labs/FLUX.2-klein-4B` (the Neuron integration tests). Both are read from this project's
tiny-shapes model instead: its tokenizer is Qwen's (the fast tests' one recorded slice, `test_image_input`,
differs by that: it fails on plain CPU too), and its pipeline is a FLUX.2-klein pipeline, so the Neuron tests
run the same code at a few million parameters (their shape, NaN and range checks hold; a slice recorded on the
real 4B weights cannot).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY = Path(__file__).resolve().parents[2] / "neuron_app" / "models" / "tiny-shapes"
HUB = {
    "hf-internal-testing/tiny-random-Qwen2VLForConditionalGeneration": TINY / "tokenizer",
    "black-forest-labs/FLUX.2-klein-4B": TINY,
}


def _redirect(cls: Any) -> None:
    original = cls.from_pretrained.__func__

    def from_pretrained(klass: Any, name: Any, *args: Any, **kwargs: Any) -> Any:
        return original(klass, str(HUB.get(name, name)) if isinstance(name, str) else name, *args, **kwargs)

    cls.from_pretrained = classmethod(from_pretrained)


def pytest_configure(config: Any) -> None:
    from diffusers import DiffusionPipeline
    from transformers import PreTrainedTokenizerBase

    _redirect(PreTrainedTokenizerBase)
    _redirect(DiffusionPipeline)
