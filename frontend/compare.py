"""Compare two configurations of one scenario side by side: pick what varies and its two values.

The drawer's form is the common base; the two runs differ in the chosen setting only, start paused,
and open as `/?run=A&compare=B` (both driven by the same controls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nicegui import ui

from kvscope.frontend.client import BackendError
from kvscope.frontend.new_run import MODELS, NewRunPanel, _maybe_await


@dataclass(frozen=True)
class Axis:
    label: str
    path: str  # the dotted override, as `--set` names it (docs/scenarios.md)
    values: dict[Any, str]  # value -> how the page names it; empty: a number typed in
    a: Any
    b: Any


SPEC_DRAFT = {"method": "draft", "draft_model": "demo-draft", "num_tokens": 4}
SPEC_NGRAM = {"method": "ngram", "num_tokens": 4}
AXES = {
    "prefix_caching": Axis("prefix caching", "engine.prefix_caching", {True: "on", False: "off"}, True, False),
    "kv_layout": Axis("KV layout", "engine.kv_layout", {"paged": "paged", "contiguous": "contiguous"}, "paged",
                      "contiguous"),
    "attention": Axis("attention", "model", MODELS, "demo-mha", "demo-mla"),
    "speculative": Axis("speculative", "engine.speculative", {"off": "off", "draft": "draft model", "ngram": "n-gram"},
                        "off", "draft"),
    "kv_cache": Axis("KV cache", "engine.kv_cache", {True: "on", False: "off"}, True, False),
    "batching": Axis("batching", "engine.batching", {"static": "static", "continuous": "continuous"}, "static",
                     "continuous"),
    "chunked_prefill": Axis("chunked prefill", "engine.chunked_prefill", {True: "on", False: "off"}, True, False),
    "kv_cache_dtype": Axis("KV dtype", "engine.kv_cache_dtype", {"auto": "model dtype", "float16": "float16",
                                                                   "bfloat16": "bfloat16", "int8": "int8"}, "auto",
                           "int8"),
    "weight_quant": Axis("weights", "engine.weight_quant", {"none": "none", "int8": "int8", "int4": "int4"}, "none",
                         "int4"),
    "weight_storage": Axis("GGUF weights", "engine.weights",
                           {"float32": "float32", "int8": "int8 per tensor", "native": "as stored (Q4: int4)"},
                           "float32", "native"),
    "tensor_parallel": Axis("tensor-parallel ranks", "engine.tensor_parallel", {1: "1", 2: "2", 4: "4"}, 1, 2),
    "block_size": Axis("block size", "engine.block_size", {}, 8, 32),
    "num_blocks": Axis("blocks", "engine.num_blocks", {}, 24, 256),
    "spec_num_tokens": Axis("draft tokens k", "engine.speculative.num_tokens", {}, 1, 8),
    "arrival_rate": Axis("arrival rate", "generate.arrival.rate_per_step", {}, 0.05, 1.0),
    "compile_decode": Axis("decode step", "engine.compile_decode", {False: "eager", True: "compiled"}, False, True),
    "batch_invariant": Axis("batch invariance", "engine.batch_invariant", {False: "default", True: "batch-invariant"},
                            False, True),
    "disaggregation": Axis("prefill and decode", "engine.disaggregation",
                           {"colocated": "colocated", "disaggregated": "disaggregated (1 + 1)"}, "colocated",
                           "disaggregated"),
}  # fmt: skip
SPEC_VALUES = {"off": None, "draft": SPEC_DRAFT, "ngram": SPEC_NGRAM}
SPLIT_VALUES = {"colocated": None, "disaggregated": {"prefill_instances": 1, "decode_instances": 1}}
# A GGUF model's weights three ways (docs/quantization.md): de-quantized to float32; those floats quantized
# to int8 with one scale per tensor (torch's int8 kernel); the file's own blocks (Q4_1: torch's int4 kernel).
WEIGHT_STORAGE = {
    "float32": {"engine.weights": "float32", "engine.weight_quant": "none"},
    "int8": {"engine.weights": "float32", "engine.weight_quant": "int8", "engine.quant_group_size": 0},
    "native": {"engine.weights": "native", "engine.weight_quant": "none"},
}


def override_of(axis: Axis, value: Any, form: dict[str, Any] | None = None,
                hold_blocks: bool = False) -> dict[str, Any]:
    """The dotted overrides that set the axis to value; `form` is the engine form the rest comes from.

    A block size alone would change the cache's memory too (the same block count of 1-token blocks
    holds 16x fewer tokens than of 16-token ones): unless `hold_blocks`, the block count follows so
    that both runs get the same KV bytes and differ in the granularity only."""
    if axis.path == "engine.speculative":
        return {axis.path: SPEC_VALUES[value]}
    if axis.path == "engine.disaggregation":
        return {axis.path: SPLIT_VALUES[value]}
    if axis.path == "engine.weights":
        return dict(WEIGHT_STORAGE[value])
    if not axis.values and float(value).is_integer() and axis.path != "generate.arrival.rate_per_step":
        value = int(value)
    if axis.path == "engine.block_size" and not hold_blocks:
        return {axis.path: value, **same_memory_blocks(value, form or {})}
    return {axis.path: value}


def same_memory_blocks(block_size: int, form: dict[str, Any]) -> dict[str, Any]:
    """The engine.num_blocks that keeps the form's token slots (block size x blocks, so its bytes) at
    `block_size`; none when the form sizes the pool from a memory budget, which fixes the bytes already."""
    blocks, size = form.get("num_blocks"), form.get("block_size")
    if not blocks or not size:
        return {}
    return {"engine.num_blocks": max(1, int(blocks) * int(size) // block_size)}


def value_label(axis: Axis, value: Any) -> str:
    return f"{axis.label} {axis.values.get(value, value)}"


class ComparePanel:
    """The drawer's "Compare" section, under the new-run form it takes its base from."""

    def __init__(self, panel: NewRunPanel) -> None:
        self.panel = panel
        ui.label("Compare two configurations").classes("kv-drawer-title")
        self.axis = ui.select({k: a.label for k, a in AXES.items()}, value="batching", label="vary",
                              on_change=self._on_axis).classes("w-full").mark("compare-axis")
        with ui.row().classes("gap-2 no-wrap w-full items-end"):
            self.a_box = ui.element("div").classes("grow")
            ui.label("vs")
            self.b_box = ui.element("div").classes("grow")
        self.hold_blocks = ui.checkbox("hold the block count (the memory changes too)").classes("kv-small") \
            .mark("compare-hold-blocks") \
            .tooltip("off: the block count follows the block size, so both runs get the same KV bytes")
        self.a: ui.element | None = None
        self.b: ui.element | None = None
        self._on_axis()
        ui.button("Side by side", icon="compare", on_click=self.start).props("outline").classes("w-full") \
            .mark("start-compare").tooltip("the scenario twice, differing in this setting only, both paused")

    def _on_axis(self) -> None:
        axis = AXES[self.axis.value]
        self.hold_blocks.set_visibility(axis.path == "engine.block_size")
        for box, attr, value in ((self.a_box, "a", axis.a), (self.b_box, "b", axis.b)):
            box.clear()
            with box:
                field = ui.select(axis.values, value=value) if axis.values else ui.number(value=value, min=0)
                setattr(self, attr, field.props("dense").classes("w-full").mark(f"compare-{attr}"))

    def choose(self, axis: str, a: Any, b: Any) -> None:
        """Set the axis and its two values (what a click on the three fields does)."""
        self.axis.set_value(axis)
        self._on_axis()
        self.a.set_value(a)
        self.b.set_value(b)

    async def start(self) -> tuple[str, str] | None:
        panel = self.panel
        if not panel.picker.value:
            ui.notify("Pick a scenario first", type="warning")
            return None
        axis = AXES[self.axis.value]
        ids = []
        try:
            for value in (self.a.value, self.b.value):
                overrides = {**panel.overrides(), **override_of(axis, value, panel.form, self.hold_blocks.value)}
                ids.append(await panel.backend.start_run(panel.picker.value, overrides, panel.speed, paused=True,
                                                         lesson=panel.has_lesson()))
        except BackendError as e:
            ui.notify(f"Could not start: {e}", type="negative", multi_line=True)
            return None
        await _maybe_await(panel.navigate(ids[0], ids[1]))
        return ids[0], ids[1]
