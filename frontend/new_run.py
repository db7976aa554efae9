"""Starting runs: scenario picker, engine config form, trace upload (comparisons: frontend/compare.py).

The model picker lists what the backend says it has (GET /api/models): the shipped demos, smollm2
when its package is installed (else shown disabled, with the install command), and any model
folder or .gguf path typed in. A scenario whose model is not installed shows the install command
instead of a start button.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from nicegui import ui
from nicegui.events import UploadEventArguments

from kvscope.frontend.client import Backend, BackendError
from kvscope.frontend.lesson import lesson_markdown, lesson_steps
from kvscope.frontend.text import md_escape

# The attention variants (the compare panel's axis); the model picker's labels come from the backend.
MODELS = {"demo": "demo (GQA)", "demo-mha": "demo-mha (MHA)", "demo-mqa": "demo-mqa (MQA)",
          "demo-mla": "demo-mla (MLA)"}
SPEEDS = {0.5: "0.5 it/s", 1.0: "1 it/s", 2.0: "2 it/s", 4.0: "4 it/s", 8.0: "8 it/s", 16.0: "16 it/s",
          64.0: "64 it/s", 0.0: "unpaced"}
# form field -> dotted override path, as `--set` names it (docs/scenarios.md)
OVERRIDE_PATHS = {
    "model": "model", "block_size": "engine.block_size", "num_blocks": "engine.num_blocks",
    "max_num_seqs": "engine.max_num_seqs", "batching": "engine.batching", "kv_layout": "engine.kv_layout",
    "kv_cache": "engine.kv_cache", "prefix_caching": "engine.prefix_caching",
    "chunked_prefill": "engine.chunked_prefill", "max_num_batched_tokens": "engine.max_num_batched_tokens",
    "weight_quant": "engine.weight_quant", "quant_group_size": "engine.quant_group_size",
    "kv_cache_dtype": "engine.kv_cache_dtype",
    "n": "generate.sampling.n", "beam_width": "generate.sampling.beam_width",
    "length_penalty": "generate.sampling.length_penalty",
}  # fmt: skip
SPEC_OFF = "off"
SPEC_METHODS = {SPEC_OFF: "off", "draft": "draft model", "ngram": "n-gram"}
DRAFT_MODELS = {"demo-draft": "demo-draft"}
DEFAULT_DRAFT, DEFAULT_NUM_TOKENS = "demo-draft", 4

Navigate = Callable[[str, str | None], Awaitable[None] | None]


def dotted_get(data: dict[str, Any], path: str) -> Any:
    """data["a"]["b"] for "a.b"; None where a part is missing."""
    for part in path.split("."):
        if not isinstance(data, dict):
            return None
        data = data.get(part)
    return data


def spec_form(spec: dict[str, Any] | None) -> dict[str, Any]:
    """engine.speculative (null or an object) as the form's three fields."""
    spec = spec or {}
    return {"spec_method": spec.get("method", SPEC_OFF), "spec_draft_model": spec.get("draft_model", DEFAULT_DRAFT),
            "spec_num_tokens": spec.get("num_tokens", DEFAULT_NUM_TOKENS)}


def speculative_of(form: dict[str, Any]) -> dict[str, Any] | None:
    """The form's three speculative fields as engine.speculative: null when off."""
    method = form.get("spec_method") or SPEC_OFF
    if method == SPEC_OFF:
        return None
    spec = {"method": method, "num_tokens": int(form.get("spec_num_tokens") or DEFAULT_NUM_TOKENS)}
    if method == "draft":  # an n-gram proposer has no model
        spec["draft_model"] = form.get("spec_draft_model") or DEFAULT_DRAFT
    return spec


def base_of(scenario: dict[str, Any]) -> dict[str, Any]:
    """The scenario's own values of every form field."""
    base = {key: dotted_get(scenario, path) for key, path in OVERRIDE_PATHS.items()}
    return {**base, **spec_form(dotted_get(scenario, "engine.speculative"))}


def overrides_of(form: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """The dotted overrides for the fields where the form differs from the scenario."""
    out = {}
    for key, path in OVERRIDE_PATHS.items():
        value = form.get(key)
        if value is None or value == "":
            continue
        if path.startswith("generate.") and base.get(key) is None:
            continue  # the scenario lists its requests one by one: there is no generate.sampling to set
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if value != base.get(key):
            out[path] = value
    # The whole object or null: a dotted path cannot reach into a speculative section that is null.
    spec = speculative_of(form)
    if spec != speculative_of(base):
        out["engine.speculative"] = spec
    return out


def model_label(model: dict[str, Any]) -> str:
    """How the picker names a model from GET /api/models: its one-line description (or how to install it)."""
    chat = " · chat template" if model["chat_template"] else ""
    return f"{model['name']} — {model['description']}{chat}"


def scenario_label(scenario: dict[str, Any]) -> str:
    """A scenario as the picker names it: one whose model is not installed says how to install it."""
    if scenario.get("available", True):
        return scenario["name"]
    return f"{scenario['name']} — {scenario['unavailable']}"


class ModelSelect(ui.select):
    """A select some of whose options are shown disabled (Quasar's `disable` on an option): models not installed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.disabled: set[str] = set()
        super().__init__(*args, **kwargs)

    def _update_options(self) -> None:
        # NiceGUI builds Quasar's option objects here ({value: index, label}); a disabled one gets `disable`.
        super()._update_options()
        for option, value in zip(self._props["options"], self._values):
            if value in self.disabled:
                option["disable"] = True


class NewRunPanel:
    """The drawer's content. `navigate(run_id, compare_id)` opens the started run(s); `start_when_drawn(run_id)`
    hands a run started paused to the page that opens it, which resumes it once it has drawn step 0."""

    def __init__(self, backend: Backend, navigate: Navigate, default_model: str | None = None,
                 start_when_drawn: Callable[[str], None] | None = None) -> None:
        self.backend = backend
        self.navigate = navigate
        self.start_when_drawn = start_when_drawn
        self.base: dict[str, Any] = {}  # the picked scenario's own values (model + engine fields)
        self.default_model = default_model
        self.form: dict[str, Any] = {"model": default_model} if default_model else {}
        self.scenarios: list[dict] = []
        self.model_labels: dict[str, str] = dict(MODELS)  # until the backend answers GET /api/models
        self.speed = 4.0
        self.paused = False
        self._build()

    def _build(self) -> None:
        ui.label("New run").classes("kv-drawer-title")
        self.picker = ui.select({}, label="scenario", on_change=self._on_pick).classes("w-full").mark("scenario") \
            .props("data-kv=scenario")
        self.about = ui.markdown("").classes("kv-small kv-lesson").mark("scenario-about") \
            .props("data-kv=scenario-about")
        with ui.expansion("Engine configuration", icon="tune").classes("w-full").props("dense"):
            self._engine_form()
        ui.timer(0.0, self.load_models, once=True)  # not awaited by the page: a first GGUF conversion takes ~10 s
        # Held at the drawer's bottom edge while the scenario's text and the engine form scroll above it: at
        # 1280x720 a long lesson text put Start run below the fold (kvscope.css: .kv-start-bar)
        with ui.column().classes("kv-start-bar w-full gap-1"):
            with ui.row().classes("items-center gap-2 w-full"):
                ui.select(SPEEDS, value=4.0, label="speed").bind_value(self, "speed").classes("w-28") \
                    .mark("start-speed").props("data-kv=start-speed")
                ui.checkbox("start paused").bind_value(self, "paused").mark("start-paused")
            self.start_button = ui.button("Start run", icon="play_arrow", on_click=self.start).classes("w-full") \
                .mark("start-run").props("data-kv=start-run")
            self.install = ui.label("").classes("kv-small").mark("scenario-install")
            self.install.set_visibility(False)
        ui.separator()
        ui.label("Replay a trace").classes("kv-drawer-title")
        ui.upload(label="trace .jsonl", auto_upload=True, on_upload=self._on_upload, max_file_size=200_000_000) \
            .props("accept=.jsonl,.json flat bordered").classes("w-full").mark("trace-upload")

    def _engine_form(self) -> None:
        f = self.form
        self.model_select = ModelSelect(self._model_options(f.get("model")), label="model", with_input=True,
                                        new_value_mode="add-unique").bind_value(f, "model").classes("w-full") \
            .mark("cfg-model").tooltip("a model by name, or type the path of a model folder or a .gguf file")
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
        self._speculative_form()
        self._quant_form()
        self._sampling_form()

    def _speculative_form(self) -> None:
        f = self.form
        ui.label("Speculative decoding").classes("kv-small")
        ui.toggle(SPEC_METHODS, value=SPEC_OFF).bind_value(f, "spec_method").props("dense").mark("cfg-spec_method")
        with ui.row().classes("gap-2 no-wrap").bind_visibility_from(f, "spec_method", backward=lambda m: m not in
                                                                     (None, SPEC_OFF)):
            ui.select(DRAFT_MODELS, label="draft model", with_input=True, new_value_mode="add-unique",
                      value=DEFAULT_DRAFT).bind_value(f, "spec_draft_model").classes("w-40") \
                .bind_visibility_from(f, "spec_method", value="draft").mark("cfg-spec_draft_model")
            ui.number("draft tokens k", min=1, max=16, precision=0, value=DEFAULT_NUM_TOKENS) \
                .bind_value(f, "spec_num_tokens").classes("w-28").mark("cfg-spec_num_tokens")

    def _quant_form(self) -> None:
        f = self.form
        with ui.row().classes("gap-2 no-wrap"):
            ui.select({"none": "none", "int8": "int8", "int4": "int4"}, label="weights").bind_value(f, "weight_quant") \
                .classes("w-24").mark("cfg-weight_quant")
            ui.number("group size", min=0, precision=0).bind_value(f, "quant_group_size").classes("w-24") \
                .mark("cfg-quant_group_size").tooltip("weights sharing one scale; 0 = one scale per tensor")
            ui.select({"auto": "model dtype", "float16": "float16", "bfloat16": "bfloat16", "int8": "int8 + scales"},
                      label="KV dtype") \
                .bind_value(f, "kv_cache_dtype").classes("w-28").mark("cfg-kv_cache_dtype")

    def _sampling_form(self) -> None:
        f = self.form
        with ui.row().classes("gap-2 no-wrap"):
            self.sampling_fields = [
                ui.number("n", min=1, max=16, precision=0).bind_value(f, "n").classes("w-16").mark("cfg-n")
                .tooltip("sequences per request (parallel sampling)"),
                ui.number("beam width", min=0, max=16, precision=0).bind_value(f, "beam_width").classes("w-24")
                .mark("cfg-beam_width").tooltip("0 = no beam search"),
                ui.number("length penalty", step=0.1).bind_value(f, "length_penalty").classes("w-28")
                .mark("cfg-length_penalty").tooltip("beam score = log p / length ** penalty"),
            ]

    def _model_options(self, *extra: str | None) -> dict[str, str]:
        return {**self.model_labels, **{m: m for m in extra if m and m not in self.model_labels}}

    async def load_models(self) -> None:
        """The picker's models from the backend (a timer's: a GGUF file's first conversion takes seconds)."""
        try:
            models = await self.backend.models()
        except BackendError as e:
            ui.notify(str(e), type="negative")
            return
        self.model_labels = {m["name"]: model_label(m) for m in models}
        self.model_select.disabled = {m["name"] for m in models if not m["installed"]}
        self.model_select.set_options(self._model_options(self.form.get("model")))

    # -- scenarios -----------------------------------------------------------------------------

    async def load(self) -> None:
        try:
            self.scenarios = await self.backend.scenarios()
        except BackendError as e:
            ui.notify(str(e), type="negative")
            return
        self.picker.set_options({s["name"]: scenario_label(s) for s in self.scenarios})
        if self.scenarios and not self.picker.value:
            self.picker.set_value(self.scenarios[0]["name"])

    async def _on_pick(self) -> None:
        name = self.picker.value
        if not name:
            return
        info = next((s for s in self.scenarios if s["name"] == name), {})
        self._show_install(info.get("unavailable"))
        steps = lesson_steps(info)
        self.about.set_content(f"{md_escape(info.get('description', ''))}\n\n**Lesson.**\n\n{lesson_markdown(steps)}"
                               if steps else md_escape(info.get("description", "")))
        try:
            scenario = await self.backend.scenario(name)
        except BackendError as e:
            ui.notify(str(e), type="negative")
            return
        if self.picker.value != name:  # picked again while this one loaded: the later pick wins
            return
        self.base = base_of(scenario)
        # sampling is set for generated requests only (a scenario's listed requests each carry their own)
        for element in self.sampling_fields:
            element.set_enabled(scenario.get("generate") is not None)
        model = self.default_model or self.base.get("model")  # a model chosen for the session stays
        self.model_select.set_options(self._model_options(model, self.form.get("model")))
        self.form.update(self.base)
        self.form["model"] = model

    def _show_install(self, unavailable: str | None) -> None:
        """A scenario that cannot run here: the install command where the start button was."""
        self.install.set_text(f"Cannot start: {unavailable}" if unavailable else "")
        self.install.set_visibility(unavailable is not None)
        self.start_button.set_visibility(unavailable is None)

    def has_lesson(self) -> bool:
        """Whether the picked scenario's lesson stops during the run: it then starts in lesson mode, paused on
        the lesson's first step, so that the class reads it before anything happens."""
        info = next((s for s in self.scenarios if s["name"] == self.picker.value), {})
        return any(step["at"] not in ("start", "finished") for step in lesson_steps(info))

    def overrides(self) -> dict[str, Any]:
        return overrides_of(self.form, self.base)

    # -- starting ----------------------------------------------------------------------------------

    async def start(self) -> str | None:
        if not self.picker.value:
            ui.notify("Pick a scenario first", type="warning")
            return None
        try:
            lesson = self.has_lesson()
            # Always paused at step 0: a lesson waits on its first step, "start paused" on play, and any
            # other run on its page, so that nobody opens a run already under way.
            run_id = await self.backend.start_run(self.picker.value, self.overrides(), self.speed, True, lesson=lesson)
        except BackendError as e:
            ui.notify(f"Could not start: {e}", type="negative", multi_line=True)
            return None
        if not (self.paused or lesson):
            if self.start_when_drawn is None:  # no page hands it on: go now
                await self.backend.control(run_id, "resume")
            else:
                self.start_when_drawn(run_id)
        await _maybe_await(self.navigate(run_id, None))
        return run_id

    async def _on_upload(self, e: UploadEventArguments) -> None:
        text = await e.file.text()
        try:
            # lesson mode on: a trace whose scenario has no lesson has no moment to pause at
            run_id = await self.backend.start_replay(text, self.speed or 4.0, paused=True, lesson=True)
        except BackendError as err:
            ui.notify(f"{e.file.name}: {err}", type="negative", multi_line=True)
            return
        await _maybe_await(self.navigate(run_id, None))


async def _maybe_await(result: Awaitable[None] | None) -> None:
    if result is not None:
        await result
