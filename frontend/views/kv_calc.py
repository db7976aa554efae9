"""KV memory calculator: the formula, the current model's numbers, and what-if inputs."""

from __future__ import annotations

from dataclasses import dataclass

from nicegui import ui

from frontend.client import RunFeed
from frontend.views.base import FeedView, view_card

EXPLANATION = """
Every layer stores a **key** and a **value** vector per KV head for every token of the context:

**bytes per token = 2 · L · N_kv · D_h · bytes**  (L layers, N_kv KV heads, D_h head dim)

Multi-head attention (MHA) has as many KV heads as query heads; grouped-query attention (GQA)
shares each KV head among a group of query heads; multi-query attention (MQA) keeps one. Multi-head
latent attention (MLA, DeepSeek) caches one compressed latent plus a small rotary key per layer:

**bytes per token = L · (kv_lora_rank + qk_rope_head_dim) · bytes**

Multiply by the context length and the number of sequences for the memory a batch needs; this is
what limits batch size and context length on a real GPU.
"""

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}


@dataclass
class KvInputs:
    variant: str = "gqa"  # mha | gqa | mqa | mla
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 32
    latent: int = 64  # kv_lora_rank + qk_rope_head_dim (MLA)
    bytes_per_value: int = 4
    context: int = 1024
    sequences: int = 8


def bytes_per_token(x: KvInputs) -> int:
    if x.variant == "mla":
        return x.n_layers * x.latent * x.bytes_per_value
    kv_heads = {"mha": x.n_heads, "mqa": 1}.get(x.variant, x.n_kv_heads)
    return 2 * x.n_layers * kv_heads * x.head_dim * x.bytes_per_value


def formula_text(x: KvInputs) -> str:
    if x.variant == "mla":
        return f"{x.n_layers} · {x.latent} · {x.bytes_per_value} B"
    kv_heads = {"mha": x.n_heads, "mqa": 1}.get(x.variant, x.n_kv_heads)
    return f"2 · {x.n_layers} · {kv_heads} · {x.head_dim} · {x.bytes_per_value} B"


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f}"


def inputs_from_header(model: dict, cache: dict) -> KvInputs:
    formula = cache.get("formula") or {}
    variant = model.get("attention", "gqa")
    return KvInputs(variant=variant, n_layers=model.get("n_layers", 1), n_heads=model.get("n_heads", 1),
                    n_kv_heads=model.get("n_kv_heads", 1), head_dim=model.get("head_dim", 1),
                    latent=formula.get("values_per_token_per_layer", 64) if variant == "mla" else 64,
                    bytes_per_value=formula.get("bytes_per_value") or DTYPE_BYTES.get(model.get("dtype", ""), 4))


def current_model_text(model: dict, cache: dict) -> str:
    """The header's own numbers: formula, bytes per token, per block and for the whole pool."""
    formula = cache.get("formula") or {}
    per_token = model.get("kv_bytes_per_token", 0)
    per_block, n = cache.get("bytes_per_block", 0), cache.get("num_blocks", 0)
    values = formula.get("values_per_token_per_layer")
    detail = f" ({formula.get('n_layers')} layers × {values} values × {formula.get('bytes_per_value')} B)" \
        if values else ""
    return (f"**{model.get('name', '?')}** ({model.get('attention', '?').upper()}, {model.get('n_heads')} query / "
            f"{model.get('n_kv_heads')} KV heads, head dim {model.get('head_dim')}, {model.get('dtype')}): "
            f"`{formula.get('text', '2 x L x N_kv x D_h x bytes')}` = **{per_token:,} B per token**{detail}; "
            f"a block of {cache.get('block_size')} tokens = {human(per_block)}; "
            f"the pool of {n} blocks = {human(per_block * n)}.")


class KvCalculatorView(FeedView):
    name = "kv_calc"

    def __init__(self, feed: RunFeed) -> None:
        self.inputs = KvInputs()
        self.fields: dict[str, ui.number] = {}
        with view_card("KV memory calculator", EXPLANATION, "w-full"):
            self.model_text = ui.markdown("").classes("kv-small").mark("kv-model")
            with ui.row().classes("items-end gap-2"):
                self.variant = ui.select({"mha": "MHA", "gqa": "GQA", "mqa": "MQA", "mla": "MLA"}, label="attention",
                                         value=self.inputs.variant, on_change=self.compute).classes("w-20") \
                    .mark("kv-variant")
                for field, label in (("n_layers", "L layers"), ("n_heads", "query heads"),
                                     ("n_kv_heads", "N_kv"), ("head_dim", "D_h"), ("latent", "MLA latent + rope"),
                                     ("bytes_per_value", "bytes/value"), ("context", "context tokens"),
                                     ("sequences", "sequences")):
                    self.fields[field] = ui.number(label, value=getattr(self.inputs, field), min=1, precision=0,
                                                   on_change=self.compute).classes("w-24").mark(f"kv-{field}")
            self.result = ui.markdown("").classes("kv-result").mark("kv-result")
            ui.button("use this run's model", on_click=self.load_model).props("flat dense size=sm") \
                .mark("kv-load-model")
        self.compute()
        super().__init__(feed)

    def full(self) -> bool:
        state = self.feed.state
        if not state.model:
            return False
        self.model_text.set_content(current_model_text(state.model, state.cache))
        self.load_model()
        return True

    def delta(self, entries) -> bool:
        return False  # the model and cache only change with a new header, which comes as a resync

    def load_model(self) -> None:
        state = self.feed.state
        if state is None or not state.model:
            return
        loaded = inputs_from_header(state.model, state.cache)
        self.variant.value = loaded.variant
        for field, element in self.fields.items():
            if field not in ("context", "sequences"):
                element.value = getattr(loaded, field)
        self.compute()

    def compute(self) -> None:
        x = self.inputs
        x.variant = self.variant.value or "gqa"
        for field, element in self.fields.items():
            setattr(x, field, _int(element.value))
        per_token = bytes_per_token(x)
        total = per_token * x.context * x.sequences
        self.result.set_content(
            f"{formula_text(x)} = **{per_token:,} B per token** · × {x.context:,} tokens × {x.sequences} "
            f"sequences = **{human(total)}**")


def _int(value: float | None) -> int:
    return max(1, int(value or 1))
