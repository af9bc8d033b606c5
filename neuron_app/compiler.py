"""How the transformer is compiled, and an exact count of the graphs that were compiled.

The count comes from a wrapper around the real backend (inductor, aot_eager or neuron): each
call of the wrapper is one graph handed to the compiler. No timing guesses.
"""

from __future__ import annotations

import threading
from typing import Any

KNOWN_BACKENDS = ("neuron", "inductor", "aot_eager", "eager")


class CountingBackend:
    """A torch.compile backend that counts its calls and delegates to the named backend."""

    def __init__(self, inner: str) -> None:
        self.inner = inner
        self.graphs = 0
        self.failures = 0
        self._lock = threading.Lock()

    def __call__(self, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        from torch._dynamo import lookup_backend

        compiler = lookup_backend(self.inner)
        try:
            compiled = compiler(gm, example_inputs, **kwargs)
        except Exception:
            with self._lock:
                self.failures += 1
            raise
        with self._lock:
            self.graphs += 1
        return compiled

    def __repr__(self) -> str:  # shows in dynamo's logs and errors
        return f"CountingBackend({self.inner!r})"


def apply_compile(transformer: Any, mode: str, backend: CountingBackend, shapes: int) -> None:
    """Wrap the transformer for `mode`; compiling itself happens on the first call per shape."""
    import torch

    # Each configured shape is one recompile of the same code; fullgraph=True turns hitting
    # dynamo's limit (8 by default) into a hard error, so leave room for every shape and retries.
    limit = max(torch._dynamo.config.recompile_limit, 2 * shapes + 8)
    torch._dynamo.config.recompile_limit = limit
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 8 * limit)
    if mode == "eager":
        return
    if mode == "full":
        transformer.compile(backend=backend, fullgraph=True, dynamic=False)
    elif mode == "regional":
        transformer.compile_repeated_blocks(backend=backend, fullgraph=True, dynamic=False)
    else:
        raise ValueError(f"unknown compile_mode {mode!r}")
