"""Weight copies, each once in the process: a model's own weights by name, its quantized copies by settings.

Weights are read-only at inference, so every run of one model with the same settings can share one
copy (before this cache each quantized run built its own: 16 paused int8 runs of SmolLM2 took the
server from 0.3 to 5.4 GB). A copy's key is everything that decides its tensors: the model's name or
path, `weight_quant` and, for a quantized copy, `quant_group_size`. Every copy is in load_model's
float32; a GGUF file loads as the folder it converts to, so it is keyed by its name like any model.

A server's runs hold the copies they use (`hold`, `release`): when a run lets go, every copy no run
holds any more is dropped, so its memory comes back once that run's engine is gone. What a headless
run or a test loads without holding stays for the life of the process (a plain cache there).
`held_bytes` is what the server's --max-weight-memory-mb bounds: every copy present, measured once
built, and until then the estimate it was reserved with.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvscope.backend.model.loader import LoadedModel, WeightsMode, load_model
from kvscope.backend.model.quant import QuantMode, quantize_loaded, weight_bytes

LOAD_DTYPE = "float32"  # load_model's default: the dtype of every copy this cache loads

Built = tuple[LoadedModel, dict | None]  # a copy and, when quantized, its header `weights` summary


@dataclass(frozen=True)
class WeightKey:
    """What decides a copy: the model, and how its linear layers are stored."""

    model: str
    quant: QuantMode = "none"
    group_size: int = 0  # 0 when not quantized: a full-precision copy has no groups
    weights: WeightsMode = "native"  # a GGUF file as stored, or de-quantized (loader.load_model)
    # Tensor parallelism: the shards ranks 1.. of one run hold in their own processes, under a tag no
    # other run shares (""; the copy in this process). Held for the accounting only: nothing here builds it.
    shards_of: str = ""

    @classmethod
    def of(cls, model: str, quant: QuantMode, group_size: int, weights: WeightsMode = "native") -> "WeightKey":
        return cls(model, quant, group_size if quant != "none" else 0, weights)


@dataclass
class WeightCopy:
    bytes: int  # measured once built; until then the estimate it was reserved with
    built: Built | None = None  # None: reserved by a run about to build it
    holders: set[str] = field(default_factory=set)


class WeightCache:
    """Every weight copy of the process, built on first use and shared; held and released by runs."""

    def __init__(self, load: Callable[..., LoadedModel] = load_model) -> None:
        self._load = load
        self._copies: dict[WeightKey, WeightCopy] = {}
        self._lock = threading.Lock()  # the copies and their holders
        # Builds take seconds (a GGUF conversion, a quantization): one at a time, so that two runs asking
        # for one new copy at once build it once. Reentrant: a quantized copy may load its model first.
        self._build_lock = threading.RLock()

    # ---- the copies -------------------------------------------------------------------------------

    def model(self, name: str, weights: WeightsMode = "native") -> LoadedModel:
        """A model's own weights (a GGUF file's as stored, unless `weights` is float32), loaded on first use."""
        return self._get(WeightKey(name, weights=weights), lambda: (self._load(name, weights=weights), None))[0]

    def quantized(self, loaded: LoadedModel, mode: QuantMode, group_size: int,
                  weights: WeightsMode = "native") -> tuple[LoadedModel, dict]:
        """quant.quantize_loaded, once per model and settings: `loaded` is this cache's `model(name, weights)`."""
        if mode == "none":  # the model itself: nothing to build
            return quantize_loaded(loaded, mode, group_size)
        built, summary = self._get(WeightKey.of(loaded.name, mode, group_size, weights),
                                   lambda: quantize_loaded(loaded, mode, group_size))
        assert summary is not None
        return built, summary

    def _get(self, key: WeightKey, build: Callable[[], Built]) -> Built:
        if (ready := self._ready(key)) is not None:
            return ready
        with self._build_lock:
            if (ready := self._ready(key)) is not None:  # built while this thread waited for its turn
                return ready
            built = build()
            with self._lock:
                copy = self._copies.setdefault(key, WeightCopy(0))
                copy.built, copy.bytes = built, weight_bytes(built[0].model)
            return built

    def _ready(self, key: WeightKey) -> Built | None:
        with self._lock:
            copy = self._copies.get(key)
            return copy.built if copy is not None else None

    # ---- holding and accounting -------------------------------------------------------------------

    def new_bytes(self, estimates: dict[WeightKey, int]) -> int:
        """What holding these copies would add: the estimates of those not present."""
        with self._lock:
            return sum(size for key, size in estimates.items() if key not in self._copies)

    def hold(self, holder: str, estimates: dict[WeightKey, int]) -> None:
        """`holder` uses these copies; one not present is reserved at its estimate, and built on first use."""
        with self._lock:
            for key, size in estimates.items():
                self._copies.setdefault(key, WeightCopy(size)).holders.add(holder)

    def release(self, holder: str) -> None:
        """`holder` is gone: every copy nobody holds is dropped (a headless load too), so its memory comes back."""
        with self._lock:
            for copy in self._copies.values():
                copy.holders.discard(holder)
            self._copies = {key: copy for key, copy in self._copies.items() if copy.holders}

    def held_bytes(self) -> int:
        with self._lock:
            return sum(copy.bytes for copy in self._copies.values())

    def describe(self) -> list[dict]:
        """Each copy present: its key, bytes, how many runs hold it and whether it is built yet."""
        with self._lock:
            return [{"model": key.model, "weights": key.weights, "quant": key.quant, "group_size": key.group_size or None,
                     "bytes": copy.bytes, "runs": len(copy.holders), "built": copy.built is not None,
                     "rank_shards": bool(key.shards_of)}
                    for key, copy in self._copies.items()]
