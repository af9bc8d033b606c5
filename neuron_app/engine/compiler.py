"""How the transformer is compiled, and an exact count of the graphs that were compiled.

The count comes from a wrapper around the real backend (inductor, aot_eager or neuron): each
call of the wrapper is one graph handed to the compiler. No timing guesses.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any


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


#: Room beyond two entries per configured shape (retries of failed compiles). A test process that builds
#: many pipelines raises it: dynamo keys its cache on code objects shared by every transformer instance.
RECOMPILE_HEADROOM = 8


@contextlib.contextmanager
def recompile_room(shapes: int) -> Iterator[None]:
    """Let dynamo compile every configured shape in this thread.

    Each shape is one recompile of the same code; under fullgraph=True, hitting dynamo's limit (8 by
    default) is a hard error. torch's config overrides are thread-local, and Gradio runs requests on
    worker threads, so the limit is raised around every pipeline call, not once at load.
    """
    import torch

    config = torch._dynamo.config
    limit = max(config.recompile_limit, 2 * shapes + RECOMPILE_HEADROOM)
    accumulated = max(config.accumulated_recompile_limit, 8 * limit)
    with config.patch(recompile_limit=limit, accumulated_recompile_limit=accumulated):
        yield


def apply_compile(transformer: Any, mode: str, backend: CountingBackend) -> None:
    """Wrap the transformer for `mode`; compiling itself happens on the first call per shape."""
    if mode == "eager":
        return
    if mode == "full":
        transformer.compile(backend=backend, fullgraph=True, dynamic=False)
    elif mode == "regional":
        transformer.compile_repeated_blocks(backend=backend, fullgraph=True, dynamic=False)
    else:
        raise ValueError(f"unknown compile_mode {mode!r}")
