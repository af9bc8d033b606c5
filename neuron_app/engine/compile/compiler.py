"""How the transformer is compiled, and an exact count of the graphs that were compiled.

The count comes from a wrapper around the real backend (inductor, aot_eager or neuron): each
call of the wrapper is one graph handed to the compiler. No timing guesses.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any


class CountingBackend:
    """A torch.compile backend that counts its calls and delegates to the named backend."""

    def __init__(
        self,
        inner: str,
        parent: CountingBackend | None = None,
        check: Callable[..., Any] | None = None,
        component: str = "transformer",
    ) -> None:
        self.inner = inner
        #: Sees every graph before the compiler does (the neuron emulator's rules, the NKI gate); what it returns,
        #: when callable, wraps the compiled graph (Neuron meters its cache misses).
        self.check = check
        self.component = component
        self.graphs = 0
        self.failures = 0
        self.parent = parent
        self._lock = threading.Lock()

    def child(self, inner: str | None = None, component: str = "vae") -> CountingBackend:
        """A counter of one component's graphs (the VAE's, the safety classifier's) that also counts into this one:
        the total stays exact."""
        return CountingBackend(inner or self.inner, parent=self, check=self.check, component=component)

    def _count(self, failed: bool) -> None:
        with self._lock:
            if failed:
                self.failures += 1
            else:
                self.graphs += 1
        if self.parent is not None:
            self.parent._count(failed)

    def __call__(self, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        from torch._dynamo import lookup_backend

        compiler = lookup_backend(self.inner)
        try:
            finish = None if self.check is None else self.check(gm, example_inputs, component=self.component)
            compiled = compiler(gm, example_inputs, **kwargs)
            if callable(finish):
                compiled = finish(compiled)
        except Exception:
            self._count(failed=True)
            raise
        self._count(failed=False)
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


def prewarm_inductor() -> None:
    """Pay inductor's one-time start-up (its imports, code cache and C++ toolchain checks) now, at load time.

    Measured on the 2-core CPU machine: that start-up was most of the first shape's compile; at load it
    runs while the page is idle (load_on_start), so the first click pays only its own graphs. The toy
    function goes straight to inductor, not through `CountingBackend`: it is not one of the app's graphs.
    """
    import torch

    def toy(x: Any) -> Any:
        return torch.nn.functional.gelu(x @ x.T + 1.0).sum(-1)

    torch.compile(toy, backend="inductor", fullgraph=True, dynamic=False)(torch.randn(8, 8))


def apply_compile(transformer: Any, mode: str, backend: CountingBackend) -> None:
    """Wrap the transformer for `mode`; compiling itself happens on the first call per shape."""
    if mode == "eager":
        return
    if backend.inner == "inductor":
        prewarm_inductor()
    if mode == "full":
        transformer.compile(backend=backend, fullgraph=True, dynamic=False)
    elif mode == "regional":
        transformer.compile_repeated_blocks(backend=backend, fullgraph=True, dynamic=False)
    else:
        raise ValueError(f"unknown compile_mode {mode!r}")
