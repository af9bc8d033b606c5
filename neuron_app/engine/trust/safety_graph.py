"""The safety classifier on the device (`safety_device = "device"`): one static-shape graph, batch 1.

On the host (the default) the classifier runs in the post stage, on `safety_threads` CPU threads, batched across
post slots: a ViT-B/16 at 224 px takes about half a second of one core per image (BENCHMARKS.md, postprocess), more than
an accelerator takes for the image itself, so a lane that hands images to it waits on its slots. On the device it is
one more compiled graph of the model's dtype: the lane classifies each image before it takes the next request (a
few milliseconds of device time on an accelerator), and the host keeps only the marks and the encode. Its input is
the classifier's own processor output (a fixed size, whatever the image's), so one graph serves every shape; batch 1
only, because the lane makes one image at a time and a batch-4 graph would never run. It compiles with the first
shape (precompile, warm-up or the first request), runs once on a blank image so that its eager ops (the cast and
the softmax after it) are compiled too, and is counted with the other graphs.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from neuron_app import tracing


class DeviceClassifier:
    """The classifier's device graph: `prepare` once (under the device lane), then `score` per image."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._model: Any = None
        self._processor: Any = None
        self._index = 0
        self._counter: Any = None
        self.compile_s: float | None = None

    @property
    def ready(self) -> bool:
        return self._model is not None

    @property
    def graphs(self) -> int:
        return 0 if self._counter is None else self._counter.graphs

    def prepare(self, loaded: tuple[Any, Any, int], manager: Any) -> None:
        """Move the loaded classifier to the device in the model's dtype, compile it with the manager's counting
        backend (its graphs count into the total, like the VAE's) and run it once."""
        with self._lock:
            if self._model is not None:
                return
            import torch
            from PIL import Image

            self._processor, model, self._index = loaded
            start = time.perf_counter()
            with tracing.span("safety_compile"):
                model.to(device=manager.backend.torch_device(), dtype=getattr(torch, manager.dtype_name))
                self._counter = manager.counter.child(component="safety")
                model.compile(backend=self._counter, dynamic=False)
                manager.backend.adopt_module(model)
                self._model = model
                self.score(Image.new("RGB", (64, 64)), manager.backend)
            self.compile_s = time.perf_counter() - start

    def score(self, image: Any, backend: Any) -> float:
        """The 'nsfw' probability of one image (PIL): the processor on the host, the graph on the device."""
        import torch

        pixels = self._processor(images=[image.convert("RGB")], return_tensors="pt")["pixel_values"]
        with backend.device_work(), torch.inference_mode():
            weight = next(self._model.parameters())  # its device as the device reports it (the emulator: neuron)
            logits = self._model(pixel_values=pixels.to(weight.device, weight.dtype)).logits
            probability = torch.softmax(logits.float(), dim=-1)[0, self._index].cpu()
        backend.synchronize()
        return float(probability)
