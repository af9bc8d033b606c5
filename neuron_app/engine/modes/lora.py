"""LoRA styles switched per request by copying weights into compiled adapter slots, one per position.

Neuron (like any torch.compile backend) compiles a graph per shape; a LoRA fused into the weights, or
a new adapter injected after compiling, would change the graph. Instead, before the transformer is
compiled, one adapter slot per position a request may fill (`max_loras_per_request`, at most the number
of configured adapters) is injected with diffusers' hotswap preparation (`enable_lora_hotswap`: ranks
padded to `max_lora_rank`, scalings turned into tensors) over the union of every configured adapter's
target modules, all slots active at once (their outputs add). Each configured adapter is then loaded once
through diffusers' `load_lora_weights(..., hotswap=True)` into slot 0 (its format conversion, rank and
alpha handling) and its slot weights and scalings are kept in memory. A request's styles are copied in
place into slots 0..k-1 and the other slots are zeroed: the graph's inputs change, its structure never
does. A server with no adapters configured injects nothing and pays nothing.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuron_app.engine.modes.lora_sources import AdapterSpec, header_rank, read_safetensors_header, tiny_rank
from neuron_app.errors import LoraError, one_line
from neuron_app.settings import Settings

log = logging.getLogger(__name__)

#: The style that means "no LoRA": an all-zero slot (same graph as every other style).
NONE = "none"
#: Slot 0's adapter name in the transformer (slot i > 0 is `style<i>`); every style is loaded through it.
SLOT = "style"
#: Bump when the tiny adapter recipe changes so older files are rebuilt.
TINY_LORA_VERSION = 1
#: The tiny transformer's attention projections a `tiny:<seed>` adapter targets (the usual FLUX LoRA targets).
TINY_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "attn.to_qkv_mlp_proj",
    "attn.to_out",
)
_LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


@dataclass
class _Prepared:
    """An adapter's slot contents, kept in memory so a switch is a copy, not a file read."""

    rank: int
    weights: list[Any]
    scalings: list[float]


def slot_name(position: int) -> str:
    """The transformer's adapter name of slot `position` (slot 0 keeps the one-slot name)."""
    return SLOT if position == 0 else f"{SLOT}{position}"


@dataclass
class AdapterSet:
    """The configured adapters (`loras`), their checks, the slot they share and the switch."""

    settings: Settings
    specs: list[AdapterSpec] = field(init=False)
    ranks: dict[str, int | None] = field(init=False)
    _prepared: dict[str, _Prepared] = field(init=False, default_factory=dict)
    _params: list[list[Any]] = field(init=False, default_factory=list)  # per slot: every module's A and B
    _modules: list[Any] = field(init=False, default_factory=list)
    _current: list[tuple[str, float]] = field(init=False, default_factory=list)  # per slot
    last_switch_s: float = field(init=False, default=0.0)
    #: The backend's synchronize, so a switch is timed to its end on an asynchronous device (review M10).
    synchronize: Callable[[], None] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        """Cheap start-up checks (before anything loads): sources parse, files exist, headers read, ranks fit."""
        self.specs = [AdapterSpec.parse(name, source) for name, source in self.settings.loras.items()]
        self.ranks = {}
        for spec in self.specs:
            rank: int | None = None
            if spec.kind == "tiny":
                rank = tiny_rank(int(spec.location))
            elif spec.kind == "file":
                try:
                    rank = header_rank(read_safetensors_header(Path(spec.location)))
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    raise LoraError(f"LoRA {spec.name!r}: {spec.location} is unreadable ({one_line(exc)})") from None
            if rank is not None:
                self._check_rank(spec, rank)
            self.ranks[spec.name] = rank

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.specs]

    @property
    def target_rank(self) -> int:
        return self.settings.max_lora_rank

    @property
    def slots(self) -> int:
        """How many styles one request may combine here: one compiled slot each (0 with no adapters)."""
        return min(self.settings.max_loras_per_request, len(self.specs))

    def _check_rank(self, spec: AdapterSpec, rank: int) -> None:
        if rank > self.target_rank:
            raise LoraError(
                f"LoRA {spec.name!r}: rank {rank} is above max_lora_rank {self.target_rank} "
                "(raise NEURON_APP_MAX_LORA_RANK: every adapter is padded to it, a new value recompiles)"
            )

    def fingerprint(self) -> dict[str, Any] | None:
        """What the adapters change in the compiled graph: the target rank and the slot's shapes, never the
        weights. None with no adapters (then the graph is the plain transformer's)."""
        if not self.specs:
            return None
        shapes: set[str] = set()
        for spec in self.specs:
            if spec.kind == "file":
                header = read_safetensors_header(Path(spec.location))
                shapes |= {f"{k}:{len(v.get('shape', []))}" for k, v in header.items()}
            elif spec.kind == "tiny":
                shapes.add(f"tiny:v{TINY_LORA_VERSION}")
            else:
                shapes.add(f"hub:{spec.location}:{spec.weight_name}")
        digest = hashlib.sha256("\n".join(sorted(shapes)).encode()).hexdigest()[:16]
        found = {"target_rank": self.target_rank, "targets": digest}
        return found if self.slots == 1 else {**found, "slots": self.slots}  # one slot: the old fingerprint

    def describe(self) -> list[dict[str, Any]]:
        """For the status panel: name, rank (None until a Hub adapter is read) and source."""
        return [{"name": s.name, "rank": self.ranks.get(s.name), "source": s.source} for s in self.specs]

    # --- preparation (before compiling) -----------------------------------------------------------------
    def prepare(self, pipe: Any) -> None:
        """Inject the slots over every adapter's targets, load each adapter once through diffusers' hotswap
        path into slot 0, keep its slot contents in memory, and leave every slot at `none`. Must run before
        compiling."""
        if not self.specs:
            return
        import torch

        start = time.perf_counter()
        transformer = pipe.transformer
        sources = {spec.name: self._materialize(spec, transformer) for spec in self.specs}
        union: dict[str, Any] = {}
        for spec in self.specs:
            for module_name in self._targets(spec, pipe, sources[spec.name], transformer):
                union[module_name] = transformer.get_submodule(module_name)
        zero: dict[str, Any] = {}
        dtype = transformer.dtype
        for module_name, module in union.items():
            zero[f"transformer.{module_name}.lora_A.weight"] = torch.zeros(
                self.target_rank, module.in_features, dtype=dtype
            )
            zero[f"transformer.{module_name}.lora_B.weight"] = torch.zeros(
                module.out_features, self.target_rank, dtype=dtype
            )
        pipe.enable_lora_hotswap(target_rank=self.target_rank)
        names = [slot_name(i) for i in range(self.slots)]
        try:
            for name in names:  # all at target_rank already; the first load also turns scalings into tensors
                # Each slot its own tensors: the loader may adopt the given ones, and slots must not share storage.
                pipe.load_lora_weights({k: v.clone() for k, v in zero.items()}, adapter_name=name)
            transformer.set_adapter(names)  # every slot active: their outputs add
        except Exception as exc:  # e.g. diffusers refuses adapters on a tensor-parallel (sharded) transformer
            raise LoraError(f"LoRA adapters cannot be added to this transformer ({one_line(exc)})") from exc
        from peft.tuners.lora import LoraLayer

        self._modules = [m for m in transformer.modules() if isinstance(m, LoraLayer) and SLOT in m.lora_A]
        for module in self._modules:
            for name in names[1:]:  # loaded after diffusers' one-time preparation: tensors here too (no recompile)
                if not isinstance(module.scaling[name], torch.Tensor):
                    module.scaling[name] = torch.tensor(float(module.scaling[name]), device=module.weight.device)
        self._params = [
            [p for m in self._modules for p in (m.lora_A[name].weight, m.lora_B[name].weight)] for name in names
        ]
        for spec in self.specs:
            location, kwargs = sources[spec.name]
            try:
                pipe.load_lora_weights(location, adapter_name=SLOT, hotswap=True, **kwargs)
            except Exception as exc:
                raise LoraError(f"LoRA {spec.name!r}: cannot be hotswapped ({one_line(exc)})") from exc
            self._prepared[spec.name] = _Prepared(
                rank=self.ranks[spec.name] or 0,
                weights=[p.detach().clone() for p in self._params[0]],
                scalings=[float(m.scaling[SLOT]) for m in self._modules],
            )
        self._current = [("", 0.0)] * self.slots  # slot 0 holds the last adapter: force the zeroing below
        self.activate(NONE, 1.0)
        log.info(
            "LoRA: %d adapter(s) ready in %d slot(s) over %d module(s), rank %d, in %.2fs",
            len(self.specs),
            self.slots,
            len(self._modules),
            self.target_rank,
            time.perf_counter() - start,
        )

    def _materialize(self, spec: AdapterSpec, transformer: Any) -> tuple[str, dict[str, Any]]:
        """Where `load_lora_weights` reads the adapter from (a `tiny:` adapter is written to the cache first)."""
        if spec.kind == "tiny":
            return str(self._write_tiny(int(spec.location), transformer)), {}
        if spec.kind == "file":
            return spec.location, {}
        token = self.settings.hf_token.get_secret_value() if self.settings.hf_token else None
        return spec.location, {"weight_name": spec.weight_name, "token": token}

    def _write_tiny(self, seed: int, transformer: Any) -> Path:
        """A random LoRA for the tiny transformer's attention projections, saved as .safetensors."""
        import torch
        from safetensors.torch import save_file

        targets = [
            (name, module)
            for name, module in transformer.named_modules()
            if isinstance(module, torch.nn.Linear) and name.endswith(TINY_TARGETS) and "." in name
        ]
        # Named after the transformer's layout too: tiny and tiny-deep may share a cache folder.
        layout = hashlib.sha256(repr([(n, m.in_features, m.out_features) for n, m in targets]).encode()).hexdigest()
        folder = self.settings.cache_dir / "loras"
        path = folder / f"tiny-{seed}-{layout[:8]}-v{TINY_LORA_VERSION}.safetensors"
        if path.is_file():
            return path
        rank = tiny_rank(seed)
        generator = torch.Generator().manual_seed(seed)
        tensors = {}
        for name, module in targets:
            down = torch.randn(rank, module.in_features, generator=generator) / module.in_features**0.5
            up = torch.randn(module.out_features, rank, generator=generator)
            tensors[f"transformer.{name}.lora_A.weight"] = down.contiguous()
            tensors[f"transformer.{name}.lora_B.weight"] = up.contiguous()
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{time.monotonic_ns()}")
        save_file(tensors, str(tmp))
        tmp.replace(path)
        return path

    def _targets(self, spec: AdapterSpec, pipe: Any, source: tuple[str, dict[str, Any]], transformer: Any) -> list[str]:
        """The transformer modules an adapter targets, checked: plain LoRA, rank within the target, modules
        that exist and are Linear (read through diffusers' own format conversion)."""
        import torch

        location, kwargs = source
        try:
            state = pipe.lora_state_dict(location, **kwargs)
        except Exception as exc:
            raise LoraError(f"LoRA {spec.name!r}: cannot be read from {spec.source} ({one_line(exc)})") from exc
        others = sorted({k.split(".")[0] for k in state if not k.startswith("transformer.")})
        if others:
            raise LoraError(f"LoRA {spec.name!r}: targets {', '.join(others)}; only transformer adapters hotswap")
        odd = [k for k in state if not k.endswith(_LORA_SUFFIXES)]
        if odd:
            raise LoraError(
                f"LoRA {spec.name!r}: only plain LoRA (lora_A/lora_B weights) can be hotswapped; found {odd[0]}"
            )
        rank = max(v.shape[0] for k, v in state.items() if k.endswith(".lora_A.weight"))
        self._check_rank(spec, rank)
        self.ranks[spec.name] = rank
        names = sorted({k.removeprefix("transformer.").rsplit(".", 2)[0] for k in state})
        absent = []
        for module_name in names:
            try:
                module = transformer.get_submodule(module_name)
            except AttributeError:
                absent.append(module_name)
                continue
            if not isinstance(module, torch.nn.Linear):
                raise LoraError(f"LoRA {spec.name!r}: targets {module_name}, which is not a Linear layer")
        if absent:
            more = f" and {len(absent) - 3} more" if len(absent) > 3 else ""
            raise LoraError(
                f"LoRA {spec.name!r}: target modules absent from this transformer: {', '.join(absent[:3])}{more} "
                "(an adapter for another model?)"
            )
        return names

    # --- the switch (under the device lock) ---------------------------------------------------------------
    @property
    def active(self) -> tuple[tuple[str, float], ...]:
        """The styles in the slots now, in slot order (zeroed slots left out)."""
        return tuple(held for held in self._current if held[0] != NONE)

    def activate(self, name: str, scale: float) -> float:
        """Put one style `name` at `scale` into slot 0 and zero the others; see `activate_all`."""
        return self.activate_all(() if name == NONE else ((name, scale),))

    def activate_all(self, styles: tuple[tuple[str, float], ...] | list[tuple[str, float]]) -> float:
        """Put `styles` (name, scale) into slots 0..k-1 and zero the rest, in place (no graph change); a slot
        that already holds its style is not touched. Returns the seconds it took."""
        wanted = [(n, float(s)) for n, s in styles][: self.slots]
        wanted += [(NONE, 1.0)] * (self.slots - len(wanted))
        changed = [i for i, (held, want) in enumerate(zip(self._current, wanted, strict=True)) if held != want]
        changed = [i for i in changed if not (wanted[i][0] == NONE and self._current[i][0] == NONE)]
        if not self.specs or not changed:
            self.last_switch_s = 0.0
            return 0.0
        import torch

        start = time.perf_counter()
        with torch.no_grad():
            for i in changed:
                name, scale = wanted[i]
                if name == NONE:
                    torch._foreach_zero_(self._params[i])
                    continue
                prepared = self._prepared[name]
                if name != self._current[i][0]:
                    torch._foreach_copy_(self._params[i], prepared.weights)
                slot = slot_name(i)
                for module, base in zip(self._modules, prepared.scalings, strict=True):
                    module.scaling[slot].fill_(base * scale)
            for i in changed:
                self._current[i] = wanted[i]
        if self.synchronize is not None:
            self.synchronize()  # an asynchronous device (Neuron) has only queued the copies: time them done
        self.last_switch_s = time.perf_counter() - start
        return self.last_switch_s

    def warm(self) -> None:
        """Switch to every style once and back (on the device, after loading): where eager ops compile on first
        use (Neuron), the switch's copies and fills compile at load, not in a user's first styled request."""
        for position in range(self.slots):
            for spec in self.specs:
                self.activate_all([(NONE, 1.0)] * position + [(spec.name, 1.0)])
        self.activate(NONE, 1.0)
