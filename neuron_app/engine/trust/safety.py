"""The safety checker: an image classifier between decode and delivery (host CPU, or the device: safety_graph.py).

Every generated image is classified before anything stores or returns it; one whose 'nsfw' probability
reaches `safety_threshold` is refused (`ContentRefused`, code content_policy_violation) and never leaves the
manager, so no entry (page, API, OpenAI API, MCP, replicas) can write or send it.

The detector is a transformers image classifier, `safety_model` (default Falconsai/nsfw_image_detection,
a ViT under Apache-2.0, labels normal/nsfw), loaded like the model (Hub id or folder). NudeNet was not
chosen: its wheel on PyPI carries an AGPL-3.0 LICENSE file while its metadata says MIT, and AGPL terms on
a network service are not a default to pick for operators. `tiny` is an offline stand-in for tests,
saved with `save_pretrained` and loaded through `from_pretrained` like the tiny FLUX.2-klein: a one-layer
ViT whose weights are set by hand so that it flags a solid magenta image and passes noise (no explicit
material anywhere, and a deterministic outcome).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from neuron_app import tracing
from neuron_app.engine.trust.safety_graph import DeviceClassifier
from neuron_app.errors import ContentRefused, ModelLoadError

log = logging.getLogger(__name__)

FLAG_LABEL = "nsfw"
TINY_SAFETY = "tiny"
TINY_FOLDER = "tiny-safety-vit-v1"
#: The stand-in flags a patch whose mean of (R + B - 2 G), with pixels scaled to [-1, 1], is above this:
#: solid magenta (255, 0, 255) gives 4, mid-grey noise about 0.
TINY_THRESHOLD = 3.0
#: What the stand-in flags, for tests and the bench.
TINY_FLAGGED_COLOUR = (255, 0, 255)
#: Most images in one classifier pass (what arrives while a pass runs waits for the next).
SAFETY_BATCH = 4


def build_tiny_safety(folder: Path) -> None:
    """Save the stand-in classifier (ViTForImageClassification + its PIL image processor) into `folder`."""
    import torch
    from transformers import ViTConfig, ViTForImageClassification
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    config = ViTConfig(
        image_size=32, patch_size=16, num_channels=3, hidden_size=4, num_hidden_layers=1, num_attention_heads=1,
        intermediate_size=8, id2label={0: "normal", 1: FLAG_LABEL}, label2id={"normal": 0, FLAG_LABEL: 1},
    )  # fmt: skip
    model = ViTForImageClassification(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        for name, param in model.named_parameters():  # layer norms: identity scale
            if "layernorm" in name and name.endswith("weight"):
                param.fill_(1.0)
        embed = model.vit.embeddings.patch_embeddings.projection
        area = config.patch_size**2
        embed.weight[0, 0], embed.weight[0, 1], embed.weight[0, 2] = 1 / area, -2 / area, 1 / area  # dim 0: R+B-2G
        embed.bias[3] = TINY_THRESHOLD  # dim 3: the threshold; the classifier compares dims 0 and 3
        # Query and key are zero: every token attends evenly, so the CLS token gets the patches' mean; value and
        # output projections pass it through (names of transformers 5, and of 4.x).
        passes = ("attention.v_proj.weight", "attention.o_proj.weight", "attention.value.weight", "output.dense.weight")
        for name, param in model.named_parameters():
            if name.endswith(passes) and "intermediate" not in name and "mlp" not in name and param.shape == (4, 4):
                param.copy_(torch.eye(4))
        model.classifier.weight[1, 0], model.classifier.weight[1, 3] = 8.0, -8.0
        model.classifier.weight[0, 0], model.classifier.weight[0, 3] = -8.0, 8.0
    processor = ViTImageProcessorPil(size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-safety-", dir=folder.parent))
    try:
        model.save_pretrained(staging)
        processor.save_pretrained(staging)
        staging.rename(folder)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / "config.json").is_file():  # another process did not win the race either
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def ensure_tiny_safety(models_dir: Path) -> Path:
    folder = models_dir / TINY_FOLDER
    if not (folder / "config.json").is_file():
        log.info("building the tiny safety classifier in %s", folder)
        build_tiny_safety(folder)
    return folder


class _Entry:
    __slots__ = ("done", "error", "item", "value")

    def __init__(self, item: Any) -> None:
        self.item, self.value, self.error, self.done = item, None, None, False


class Batcher:
    """Calls of `run(items) -> results` batched as they come: the first caller runs at once with what is queued (up
    to `size`), later callers join the next batch, so batching never makes an image wait for others to arrive."""

    def __init__(self, run: Any, size: int) -> None:
        self._run, self.size = run, size
        self._cond = threading.Condition()
        self._queue: list[_Entry] = []
        self._busy = False
        self.batches: list[int] = []  # the last batches' sizes (the bench, tests)

    def __call__(self, item: Any) -> Any:
        entry = _Entry(item)
        with self._cond:
            self._queue.append(entry)
        while True:
            with self._cond:
                while self._busy and not entry.done:
                    self._cond.wait()
                if entry.done:
                    break
                self._busy = True
                batch, self._queue = self._queue[: self.size], self._queue[self.size :]
                self.batches = [*self.batches[-63:], len(batch)]
            try:
                results = self._run([e.item for e in batch])
                for e, value in zip(batch, results, strict=True):
                    e.value = value
            except Exception as exc:  # the classifier failed: every image of this batch fails with it
                for e in batch:
                    e.error = exc
            finally:
                with self._cond:
                    for e in batch:
                        e.done = True
                    self._busy = False
                    self._cond.notify_all()
        if entry.error is not None:
            raise entry.error
        return entry.value


def clip(text: str, limit: int = 400) -> str:
    """`text` up to `limit` characters, cut between words with an ellipsis (a message cut mid-word reads broken)."""
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0].rstrip(" ,;:(") + " ..."


class SafetyChecker:
    """Loads the classifier (at start when `on`, in the background at first use when `auto`), classifies, counts
    passed and flagged images. A load that failed is remembered: later requests are refused at once with its
    message, and status shows it."""

    def __init__(self, settings: Any) -> None:
        self.enabled = settings.safety_on
        self.eager = settings.safety_checker == "on"  # asked for by name: load it at start, not at the first click
        self.error: str | None = None
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.model_id = settings.safety_model
        self.threshold = settings.safety_threshold
        self.models_dir = settings.cache_dir / "models"
        self.hf_token = settings.hf_token.get_secret_value() if settings.hf_token else None
        self._lock = threading.Lock()
        self._loaded: tuple[Any, Any, int] | None = None  # processor, model, index of the flag label
        self.passed = 0
        self.flagged = 0
        self.seconds = 0.0  # classifying time, summed
        self.threads = getattr(settings, "safety_threads", 1)
        self._batcher = Batcher(self.score_batch, SAFETY_BATCH)
        self.on_device = getattr(settings, "safety_device", "host") == "device"
        self.device = DeviceClassifier()  # `safety_device = "device"`: the graph the lane runs (safety_graph.py)

    @property
    def state(self) -> str:
        return "on" if self.enabled else "off"

    def start(self) -> threading.Thread | None:
        """Begin loading in the background (once); a failure lands in `error`, for status and the next request."""
        with self._start_lock:  # not the load's lock: a load in progress must not make this wait
            if not self.enabled or self._loaded is not None or self.error or self._thread is not None:
                return None
            self._thread = threading.Thread(target=self._load_quietly, name="safety-load", daemon=True)
        self._thread.start()
        return self._thread

    def at_start(self) -> None:
        """At the app's start: `on` loads now, beside the page; `auto` waits for the first request."""
        if self.eager:
            self.start()

    def _load_quietly(self) -> None:
        try:
            self.load()
        except ModelLoadError as exc:
            log.error("%s", exc)

    def refuse_if_failed(self) -> None:
        """A checker that could not load refuses at once (before any model work), with the whole message."""
        if self.enabled and self.error:
            raise ModelLoadError(self.error)

    def ready(self) -> None:
        """Before device work: `on` waits for the classifier (raises `ModelLoadError` when it cannot load); `auto`
        starts its load beside the model's work, and `check` waits for it."""
        if not self.enabled:
            return
        if self.eager:
            self.load()
        else:
            self.start()

    def load(self) -> tuple[Any, Any, int]:
        if self._loaded is not None:
            return self._loaded
        with self._lock:
            self.refuse_if_failed()
            if self._loaded is None:
                try:
                    self._loaded = self._load()
                except ModelLoadError as exc:
                    self.error = str(exc)
                    raise
        return self._loaded

    def _load(self) -> tuple[Any, Any, int]:
        from transformers import AutoImageProcessor, AutoModelForImageClassification

        source = str(ensure_tiny_safety(self.models_dir)) if self.model_id == TINY_SAFETY else self.model_id
        try:
            processor = AutoImageProcessor.from_pretrained(source, token=self.hf_token, backend="pil")
            model = AutoModelForImageClassification.from_pretrained(source, token=self.hf_token).eval()
        except Exception as exc:  # offline, gated, not a classifier: the checker cannot run, so nothing is served
            reason = clip(" ".join(str(exc).split()))
            raise ModelLoadError(
                f"the safety checker's model {self.model_id!r} could not be loaded ({type(exc).__name__}: "
                f"{reason}); set safety_model to a local folder, or safety_checker = off"
            ) from exc
        labels = {str(name).lower(): int(i) for i, name in model.config.id2label.items()}
        if FLAG_LABEL not in labels:
            raise ModelLoadError(
                f"the safety model {self.model_id!r} has no {FLAG_LABEL!r} label (labels: {sorted(labels)})"
            )
        log.info("safety checker loaded: %s", self.model_id)
        return processor, model, labels[FLAG_LABEL]

    def score(self, image: Any) -> float:
        """The classifier's probability that `image` (PIL) is nsfw; images of other post slots that arrive while a
        batch runs are classified together in the next one."""
        return self._batcher(image)

    def score_batch(self, images: list[Any]) -> list[float]:
        """One forward pass over `images` on `safety_threads` threads (torch's OpenMP threads are this thread's
        own: set for the pass, then given back, so the device work of the same thread keeps its count)."""
        import torch

        processor, model, index = self.load()
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            with torch.inference_mode():
                inputs = processor(images=[image.convert("RGB") for image in images], return_tensors="pt")
                logits = model(**inputs).logits
        finally:
            torch.set_num_threads(before)
        return [float(p) for p in torch.softmax(logits.float(), dim=-1)[:, index]]

    def prepare_device(self, manager: Any) -> None:
        """The device path: its graph compiled (with the first shape) before any image needs it; else nothing."""
        if self.enabled and self.on_device and not self.device.ready:
            self.device.prepare(self.load(), manager)

    def check_on_device(self, image: Any, manager: Any) -> str | None:
        """The device path's check, run by the lane before it lets the device go; None on the host path (the post
        stage checks there)."""
        if not (self.enabled and self.on_device):
            return None
        self.prepare_device(manager)
        return self.check(image, manager.backend)

    def check(self, image: Any, backend: Any = None) -> str:
        """'passed' or 'off'; a flagged image raises `ContentRefused` (the caller drops the image). With `backend`,
        on the device graph."""
        with tracing.span("safety", checker="on" if self.enabled else "off", device=backend is not None):
            return self._check(image, backend)

    def _check(self, image: Any, backend: Any) -> str:
        if not self.enabled:
            return "off"
        start = time.perf_counter()
        score = self.score(image) if backend is None else self.device.score(image, backend)
        self.seconds += time.perf_counter() - start
        if score >= self.threshold:
            self.flagged += 1
            log.warning("safety checker flagged an image (score %.2f >= %.2f): refused", score, self.threshold)
            raise ContentRefused(
                "the generated image was flagged by this server's safety checker and is not returned; "
                "try another prompt or seed",
                param=None,
            )
        self.passed += 1
        return "passed"

    def snapshot(self) -> dict[str, Any]:
        return {
            "checker": self.state,
            "model": self.model_id if self.enabled else None,
            "passed": self.passed,
            "flagged": self.flagged,
            "error": self.error if self.enabled else None,
            "device": "device" if self.on_device else "host",
            "graphs": self.device.graphs,
        }
