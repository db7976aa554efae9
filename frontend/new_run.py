"""Starting runs: scenario picker, engine config form, side-by-side comparison, trace upload."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from nicegui import ui
from nicegui.events import UploadEventArguments

from frontend.client import Backend, BackendError
from frontend.text import md_escape

MODELS = {"demo": "demo (GQA)", "demo-mha": "demo-mha (MHA)", "demo-mqa": "demo-mqa (MQA)",
          "demo-mla": "demo-mla (MLA)"}
SPEEDS = {0.5: "0.5 it/s", 1.0: "1 it/s", 2.0: "2 it/s", 4.0: "4 it/s", 8.0: "8 it/s", 16.0: "16 it/s",
          64.0: "64 it/s", 0.0: "unpaced"}
# form field -> dotted override path (CONTRACT §3)
OVERRIDE_PATHS = {
    "model": "model", "block_size": "engine.block_size", "num_blocks": "engine.num_blocks",
    "max_num_seqs": "engine.max_num_seqs", "batching": "engine.batching", "kv_layout": "engine.kv_layout",
    "kv_cache": "engine.kv_cache", "prefix_caching": "engine.prefix_caching",
    "chunked_prefill": "engine.chunked_prefill", "max_num_batched_tokens": "engine.max_num_batched_tokens",
}  # fmt: skip

Navigate = Callable[[str, str | None], Awaitable[None] | None]


def overrides_of(form: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """The dotted overrides for the fields where the form differs from the scenario."""
    out = {}
    for key, path in OVERRIDE_PATHS.items():
        value = form.get(key)
        if value is None or value == "":
            continue
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if value != base.get(key):
            out[path] = value
    return out


class NewRunPanel:
    """The drawer's content. `navigate(run_id, compare_id)` opens the started run(s)."""

    def __init__(self, backend: Backend, navigate: Navigate, default_model: str | None = None) -> None:
        self.backend = backend
        self.navigate = navigate
        self.base: dict[str, Any] = {}  # the picked scenario's own values (model + engine fields)
        self.default_model = default_model
        self.form: dict[str, Any] = {"model": default_model} if default_model else {}
        self.scenarios: list[dict] = []
        self.speed = 4.0
        self.paused = False
        self._build()

    def _build(self) -> None:
        ui.label("New run").classes("kv-drawer-title")
        self.picker = ui.select({}, label="scenario", on_change=self._on_pick).classes("w-full").mark("scenario")
        self.about = ui.markdown("").classes("kv-small kv-lesson").mark("scenario-about")
        with ui.expansion("Engine configuration", icon="tune").classes("w-full").props("dense"):
            self._engine_form()
        with ui.row().classes("items-center gap-2 w-full"):
            ui.select(SPEEDS, value=4.0, label="speed").bind_value(self, "speed").classes("w-28").mark("start-speed")
            ui.checkbox("start paused").bind_value(self, "paused").mark("start-paused")
        ui.button("Start run", icon="play_arrow", on_click=self.start).classes("w-full").mark("start-run")
        ui.button("Side by side: static vs continuous", icon="compare", on_click=self.start_compare) \
            .props("outline").classes("w-full").mark("start-compare") \
            .tooltip("the same scenario twice, one column each, driven by the same controls")
        ui.separator()
        ui.label("Replay a trace").classes("kv-drawer-title")
        ui.upload(label="trace .jsonl", auto_upload=True, on_upload=self._on_upload, max_file_size=200_000_000) \
            .props("accept=.jsonl,.json flat bordered").classes("w-full").mark("trace-upload")

    def _engine_form(self) -> None:
        f = self.form
        self.model_select = ui.select(self._model_options(f.get("model")), label="model", with_input=True,
                                      new_value_mode="add-unique").bind_value(f, "model").classes("w-full") \
            .mark("cfg-model").tooltip("a shipped model, or type the path of a model folder")
        with ui.row().classes("gap-2 no-wrap"):
            ui.number("block size", min=1, max=256, precision=0).bind_value(f, "block_size").classes("w-24") \
                .mark("cfg-block_size")
            ui.number("blocks", min=1, precision=0).bind_value(f, "num_blocks").classes("w-24").mark("cfg-num_blocks")
            ui.number("max seqs", min=1, precision=0).bind_value(f, "max_num_seqs").classes("w-24") \
                .mark("cfg-max_num_seqs")
        ui.toggle({"continuous": "continuous", "static": "static"}).bind_value(f, "batching").props("dense") \
            .mark("cfg-batching")
        ui.toggle({"paged": "paged", "contiguous": "contiguous"}).bind_value(f, "kv_layout").props("dense") \
            .mark("cfg-kv_layout")
        ui.switch("KV cache").bind_value(f, "kv_cache").mark("cfg-kv_cache")
        ui.switch("prefix caching").bind_value(f, "prefix_caching").mark("cfg-prefix_caching")
        with ui.row().classes("items-center gap-2 no-wrap"):
            ui.switch("chunked prefill").bind_value(f, "chunked_prefill").mark("cfg-chunked_prefill")
            ui.number("token budget", min=1, precision=0).bind_value(f, "max_num_batched_tokens").classes("w-28") \
                .mark("cfg-max_num_batched_tokens")

    @staticmethod
    def _model_options(*extra: str | None) -> dict[str, str]:
        return {**MODELS, **{m: m for m in extra if m and m not in MODELS}}

    # -- scenarios -----------------------------------------------------------------------------

    async def load(self) -> None:
        try:
            self.scenarios = await self.backend.scenarios()
        except BackendError as e:
            ui.notify(str(e), type="negative")
            return
        self.picker.set_options({s["name"]: s["name"] for s in self.scenarios})
        if self.scenarios and not self.picker.value:
            self.picker.set_value(self.scenarios[0]["name"])

    async def _on_pick(self) -> None:
        name = self.picker.value
        if not name:
            return
        info = next((s for s in self.scenarios if s["name"] == name), {})
        description, lesson = md_escape(info.get("description", "")), md_escape(info.get("lesson", ""))
        self.about.set_content(f"{description}\n\n**Lesson.** {lesson}")
        try:
            scenario = await self.backend.scenario(name)
        except BackendError as e:
            ui.notify(str(e), type="negative")
            return
        engine = scenario.get("engine", {})
        self.base = {"model": scenario.get("model"), **{k: engine.get(k) for k in OVERRIDE_PATHS if k != "model"}}
        model = self.default_model or self.base.get("model")  # a model chosen for the session stays
        self.model_select.set_options(self._model_options(model, self.form.get("model")))
        self.form.update(self.base)
        self.form["model"] = model

    def overrides(self) -> dict[str, Any]:
        return overrides_of(self.form, self.base)

    # -- starting ----------------------------------------------------------------------------------

    async def start(self) -> str | None:
        if not self.picker.value:
            ui.notify("Pick a scenario first", type="warning")
            return None
        try:
            run_id = await self.backend.start_run(self.picker.value, self.overrides(), self.speed, self.paused)
        except BackendError as e:
            ui.notify(f"Could not start: {e}", type="negative", multi_line=True)
            return None
        await _maybe_await(self.navigate(run_id, None))
        return run_id

    async def start_compare(self) -> tuple[str, str] | None:
        """The picked scenario twice (static vs continuous batching), both paused until Play."""
        if not self.picker.value:
            ui.notify("Pick a scenario first", type="warning")
            return None
        ids = []
        try:
            for batching in ("static", "continuous"):
                overrides = {**self.overrides(), "engine.batching": batching}
                ids.append(await self.backend.start_run(self.picker.value, overrides, self.speed, paused=True))
        except BackendError as e:
            ui.notify(f"Could not start: {e}", type="negative", multi_line=True)
            return None
        await _maybe_await(self.navigate(ids[0], ids[1]))
        return ids[0], ids[1]

    async def _on_upload(self, e: UploadEventArguments) -> None:
        text = await e.file.text()
        try:
            run_id = await self.backend.start_replay(text, self.speed or 4.0, paused=True)
        except BackendError as err:
            ui.notify(f"{e.file.name}: {err}", type="negative", multi_line=True)
            return
        await _maybe_await(self.navigate(run_id, None))


async def _maybe_await(result: Awaitable[None] | None) -> None:
    if result is not None:
        await result
