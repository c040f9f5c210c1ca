"""LoRA adapters loaded at run time and chosen per request (`spindle serve --lora-dir DIR --max-loras N`).

Every adapter is a PEFT adapter of its own, loaded by the family's diffusers pipeline
(`load_lora_weights(..., adapter_name=NAME)`, the readers `spindle generate --lora` uses: diffusers,
PEFT and the original layouts), and never merged into the base weights. A request picks one with
`activate(name, scale)` before it runs: diffusers' `set_adapters([name], [scale])` makes it the only
active adapter of every LoRA layer with its scaling recomputed from the adapter's own alpha / rank
(nothing accumulates from one request to the next), and `activate(None)` turns the LoRA layers off,
so the base layers alone compute (exactly the base model). One request runs at a time (the caller
serializes runs, loads and unloads), so a request only ever sees its own adapter's weights.

The cache holds at most `max_loras` adapters. Loading one more unloads the least recently used one
that no waiting or running request holds (`pin` / `unpin`); unloading is diffusers' `delete_adapters`,
which drops the adapter's tensors from every LoRA layer (the memory is freed). Loading reads only
from `lora_dir`: a path that resolves outside it (symlinks followed) is refused, naming the folder.

Engine code: no family is named here; the family record gives the pipeline class.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spindle.contracts.request import RequestError

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
PEFT_WEIGHTS = "adapter_model.safetensors"  # a PEFT adapter folder (with adapter_config.json)
# an adapter name becomes a key of PEFT's ModuleDicts (no dots) and a URL path segment
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class AdapterError(ValueError):
    """A refused adapter operation. `status`: the HTTP status a server answers with (400 bad name or
    file, 403 a path outside the allowed folder, 404 not found, 409 in use / conflicting)."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_lora"):
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass
class Adapter:
    """One loaded adapter: its name, the file it came from, and what the file records."""

    name: str
    path: Path
    loaded_at: float
    last_used: float
    parameters: int  # LoRA tensor elements loaded (what it costs in memory, in parameters)
    max_text_length: int | None = None  # the text length it was trained with (its export record)
    trained_for: str | None = None

    def as_dict(self, root: Path | None, pins: int) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": str(self.path.relative_to(root)) if root is not None else str(self.path),
            "loaded_at": int(self.loaded_at),
            "last_used": int(self.last_used),
            "parameters": self.parameters,
            "in_use": pins,
            "max_text_length": self.max_text_length,
        }


class LoraAdapters:
    """The adapters of one engine (see the module docstring). `max_loras=None`: no bound (a follower
    rank that only mirrors rank 0's loads and unloads)."""

    def __init__(
        self,
        family: Any,
        components: dict[str, Any],
        transformer_name: str,
        lora_dir: str | Path | None,
        max_loras: int | None = 4,
    ):
        from spindle.infer.lora import LORA_COMPONENTS, lora_pipeline

        self.family = family
        self.components = components
        # every denoiser an adapter may go into (a two-expert checkpoint's transformer_2 too)
        self.denoisers = [components[n] for n in LORA_COMPONENTS if components.get(n) is not None]
        self.pipe = lora_pipeline(family, components)
        self.root = Path(lora_dir).resolve() if lora_dir is not None else None
        self.max_loras = max_loras
        self._loaded: OrderedDict[str, Adapter] = OrderedDict()  # least recently used first
        self._pins: Counter[str] = Counter()
        # the bookkeeping (names, pins; re-entrant: an error message lists the names); the caller serializes
        # the model changes
        self._lock = threading.RLock()
        self._lora_layers = False  # whether any adapter was ever injected (then activate(None) disables them)

    # ---------------------------------------------------------------- what there is

    def names(self) -> list[str]:
        with self._lock:
            return list(self._loaded)

    def get(self, name: str) -> Adapter | None:
        with self._lock:
            return self._loaded.get(name)

    def listing(self) -> list[dict[str, Any]]:
        with self._lock:
            return [a.as_dict(self.root, self._pins[a.name]) for a in self._loaded.values()]

    def available(self) -> list[str]:
        """What `lora_dir` holds that `load` can take: .safetensors files and adapter folders (diffusers'
        or PEFT's), as paths relative to it (sorted)."""
        if self.root is None:
            return []
        found = [p for p in self.root.rglob("*.safetensors") if p.name not in (LORA_WEIGHTS, PEFT_WEIGHTS)]
        found += [p.parent for weights in (LORA_WEIGHTS, PEFT_WEIGHTS) for p in self.root.rglob(weights)]
        return sorted({str(p.relative_to(self.root)) for p in found})

    def unknown(self, name: str, field: str = "lora") -> RequestError:
        loaded = ", ".join(self.names()) or "none"
        return RequestError(f"{field}: no loaded LoRA adapter named {name!r} (loaded: {loaded})", field=field)

    # ---------------------------------------------------------------- requests

    def check_request(self, name: Any, scale: Any) -> tuple[str | None, float | None]:
        """A request's (`lora`, `lora_scale`) checked: the name of a loaded adapter (or None) and a
        finite scale (default 1 when an adapter is named). Raises `RequestError` naming the field."""
        if name is None:
            if scale is not None:
                raise RequestError("lora_scale needs lora: name the adapter it scales", field="lora_scale")
            return None, None
        if not isinstance(name, str):
            raise RequestError(f"lora must be the name of a loaded adapter; got {type(name).__name__}", field="lora")
        if self.get(name) is None:
            raise self.unknown(name)
        if scale is None:
            scale = 1.0
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise RequestError(f"lora_scale must be a finite number (1: as trained); got {scale!r}", field="lora_scale")
        return name, float(scale)

    def pin(self, name: str) -> None:
        """Hold `name` loaded for a request that will run later (not evicted, not unloaded)."""
        with self._lock:
            if name not in self._loaded:
                raise self.unknown(name)
            self._pins[name] += 1

    def unpin(self, name: str) -> None:
        with self._lock:
            self._pins[name] -= 1
            if self._pins[name] <= 0:
                del self._pins[name]

    def activate(self, name: str | None, scale: float = 1.0) -> None:
        """Make `name` (scaled) the only active adapter, or none. Called before every run."""
        if name is None:
            if self._lora_layers:
                self.pipe.disable_lora()
            return
        with self._lock:
            adapter = self._loaded.get(name)
            if adapter is None:
                raise self.unknown(name)
            adapter.last_used = time.time()
            self._loaded.move_to_end(name)
        self.pipe.enable_lora()
        self.pipe.set_adapters([name], adapter_weights=[float(scale)])
        self._freeze()

    # ---------------------------------------------------------------- loading and unloading

    def resolve(self, path: str | None, name: str) -> Path:
        """The adapter file or folder `path` names inside `lora_dir` (relative to it, or absolute but
        inside it); no path: `name` itself, as `name.safetensors` or a folder `name`."""
        if self.root is None:
            raise AdapterError(
                "this server loads no LoRA adapters at run time: start it with --lora-dir DIR (the folder of "
                "adapters clients may load)",
                status=403,
                code="lora_loading_disabled",
            )
        if path is None:
            candidates = [self.root / f"{name}.safetensors", self.root / name]
        else:
            given = Path(path)
            candidates = [given if given.is_absolute() else self.root / given]
        for candidate in candidates:
            resolved = candidate.resolve()
            if not resolved.is_relative_to(self.root):
                raise AdapterError(
                    f"lora_path {path!r} is outside the adapter folder this server allows ({self.root}, --lora-dir); "
                    "give a path inside it",
                    status=403,
                    code="lora_path_not_allowed",
                )
            if resolved.is_file() or (resolved / LORA_WEIGHTS).is_file() or (resolved / PEFT_WEIGHTS).is_file():
                return resolved
        shown = path if path is not None else f"{name}.safetensors or {name}/{LORA_WEIGHTS}"
        available = self.available()
        listing = ", ".join(available[:20]) + (" ..." if len(available) > 20 else "") if available else "none"
        raise AdapterError(
            f"lora_path: no adapter {shown!r} in {self.root} (available: {listing})", status=404, code="lora_not_found"
        )

    def check_name(self, name: Any) -> str:
        if not isinstance(name, str) or not NAME.match(name):
            raise AdapterError(
                f"lora_name must be 1-64 letters, digits, '_' or '-'; got {name!r}",
                status=400,
                code="invalid_lora_name",
            )
        return name

    def plan_load(self, name: str, path: Path) -> list[str]:
        """Check that `name` can be loaded from `path` now. -> the adapters to unload first (least
        recently used, not pinned) to stay within `max_loras`; [] when `name` is already loaded from
        `path` (loading is then a no-op)."""
        with self._lock:
            existing = self._loaded.get(name)
            if existing is not None:
                if existing.path == path:
                    return []
                raise AdapterError(
                    f"lora_name {name!r} is already loaded from {existing.path}; unload it first (DELETE "
                    f"/v1/loras/{name}) or choose another name",
                    status=409,
                    code="lora_name_taken",
                )
            if self.max_loras is None or len(self._loaded) < self.max_loras:
                return []
            free = [n for n in self._loaded if not self._pins[n]]
            excess = len(self._loaded) + 1 - self.max_loras
            if len(free) < excess:
                raise AdapterError(
                    f"all {self.max_loras} adapter slots (--max-loras) hold adapters that waiting or running requests "
                    "use; retry when they are done, or start the server with a larger --max-loras",
                    status=409,
                    code="lora_cache_full",
                )
            return free[:excess]

    def load(self, name: str, path: Path) -> Adapter:
        """Load `path` as adapter `name` (after `plan_load`'s evictions). A file that does not fit the
        model raises `AdapterError` and leaves nothing behind."""
        from spindle.export.record import trained_text_length
        from spindle.infer.lora import load_adapter, lora_transformer

        existing = self.get(name)
        if existing is not None and existing.path == path:
            return existing
        try:  # into the denoiser it was trained for (a low-noise expert's LoRA: transformer_2)
            metadata = load_adapter(
                self.family, self.pipe, lora_transformer(self.family, self.components, path), path, name
            )
        except (ValueError, FileNotFoundError) as e:
            self._drop_layers(name)  # a partial load (some components) must not stay behind
            raise AdapterError(str(e), status=400, code="invalid_lora") from None
        finally:
            self._lora_layers = True
            self._after_change()
        now = time.time()
        adapter = Adapter(
            name=name,
            path=path,
            loaded_at=now,
            last_used=now,
            parameters=self._parameters(name),
            max_text_length=trained_text_length(None, path),  # as `lora=PATH` at load reads it
            trained_for=metadata.get("family"),
        )
        with self._lock:
            self._loaded[name] = adapter
        return adapter

    def unload(self, name: str, force: bool = False) -> Adapter:
        """Drop adapter `name` and free its tensors. Refused (409) while a request holds it, unless
        `force` (a follower rank mirroring rank 0, which already decided)."""
        with self._lock:
            adapter = self._loaded.get(name)
            if adapter is None:
                loaded = ", ".join(self._loaded) or "none"
                raise AdapterError(f"no loaded LoRA adapter named {name!r} (loaded: {loaded})", 404, "lora_not_found")
            if self._pins[name] and not force:
                raise AdapterError(
                    f"LoRA adapter {name!r} is named by {self._pins[name]} waiting or running request(s); unload it "
                    "once they are done",
                    status=409,
                    code="lora_in_use",
                )
            del self._loaded[name]
        self._drop_layers(name)
        self._after_change()
        return adapter

    # ---------------------------------------------------------------- internals

    def _drop_layers(self, name: str) -> None:
        if any(name in adapters for adapters in self.pipe.get_list_adapters().values()):
            self.pipe.delete_adapters([name])

    def _after_change(self) -> None:
        """After LoRA layers were added or removed: the fused Linear + GELU pairs a LoRA now wraps run
        unfused (the fused call would bypass the adapter), and nothing trains."""
        from spindle.infer.speedups import unfuse_wrapped_linear_gelu

        for denoiser in self.denoisers:
            unfuse_wrapped_linear_gelu(denoiser)
        self._freeze()

    def _freeze(self) -> None:
        # PEFT's set_adapter marks the active adapter trainable; inference never needs gradients
        for component in self.pipe.components.values():
            if hasattr(component, "requires_grad_"):
                component.requires_grad_(False)

    def _parameters(self, name: str) -> int:
        return sum(p.numel() for d in self.denoisers for n, p in d.named_parameters() if f".{name}." in n)
