"""An LRU of encoded prompts: seed sweeps, several images and repeated edits skip the text encoder.

FLUX.2-klein encodes a prompt with a Qwen3 model (4B parameters' worth of work per request on the
real model) whose result depends only on the prompt text, `max_sequence_length` and the model's
weights. The key holds exactly those (the model through the compile fingerprint, which names the
model, its revision, dtype and device), and the value is what the pipeline's own `encode_prompt`
returned, passed back as `prompt_embeds`: the images are bit-identical with and without the cache.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from neuron_app import tracing


class PromptCache:
    """`size` encoded prompts, least recently used evicted first; 0 disables it (every call encodes)."""

    def __init__(self, size: int, fingerprint: str) -> None:
        self.size = size
        self.fingerprint = fingerprint
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[tuple[str, int, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self._local = threading.local()  # `not_a_user_prompt` in this thread

    @contextlib.contextmanager
    def not_a_user_prompt(self) -> Iterator[None]:
        """The compile's own run (the warm-up prompt): encoded as a request would be, neither counted in hits and
        misses nor kept (it would take a user prompt's place)."""
        self._local.off = True
        try:
            yield
        finally:
            self._local.off = False

    def embeds(self, pipe: Any, prompt: str, max_sequence_length: int) -> Any:
        """The prompt's embeddings, encoded by the pipeline on a miss; None when the cache is off."""
        if self.size <= 0:
            return None
        with tracing.span("prompt_cache") as span:
            embeds, hit = self._embeds(pipe, prompt, max_sequence_length)
            if span is not None:
                span.set_attribute("prompt_cache.hit", hit)
            return embeds

    def _embeds(self, pipe: Any, prompt: str, max_sequence_length: int) -> tuple[Any, bool]:
        if getattr(self._local, "off", False):
            return self._encode(pipe, prompt, max_sequence_length), False
        key = (prompt, max_sequence_length, self.fingerprint)
        with self._lock:
            cached = self._entries.get(key)
            if cached is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return cached, True
        embeds = self._encode(pipe, prompt, max_sequence_length)
        with self._lock:
            self.misses += 1
            self._entries[key] = embeds
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return embeds, False

    @staticmethod
    def _encode(pipe: Any, prompt: str, max_sequence_length: int) -> Any:
        with tracing.span("text_encoder"):
            embeds, _text_ids = pipe.encode_prompt(
                prompt=prompt, device=pipe._execution_device, max_sequence_length=max_sequence_length
            )
        return embeds

    def snapshot(self) -> dict[str, int]:
        """Hits, misses, entries and capacity, for status and /metrics."""
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "entries": len(self._entries), "size": self.size}
