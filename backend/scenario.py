"""Scenario files: a named request mix plus engine settings, validated and expanded into requests.

See docs/scenarios.md for the format. Drawn prompts (`prompt_tokens: N`) come, seeded, from the
project's own prompt pool: the validation split of Tiny Shakespeare, tokenized by the run's model.
Chat requests (`messages:`) are written with the run's model's chat template, as the OpenAI API's
chat completions are. A scenario whose model needs a package that is not installed (`smollm2`)
cannot run, and says which command installs it, unless it names a `fallback_model` (the demo) to
run instead.
"""

from __future__ import annotations

import difflib
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from kvscope import part_dir
from kvscope.backend.config import EngineConfig
from kvscope.backend.errors import KvscopeError, pydantic_reason
from kvscope.backend.events.moments import MomentKind, ViewName
from kvscope.backend.events.questions import QUESTIONS, QuestionKind
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.model.chat import encode_chat
from kvscope.backend.model.packages import SHIPPED_MODELS, missing_package
from kvscope.backend.model.tokenizer import Tokenizer, read_corpus
from kvscope.backend.perf.hardware import HARDWARE_NAMES, LINKS
from kvscope.backend.perf.shapes import SHAPES

if TYPE_CHECKING:
    from kvscope.backend.model.loader import LoadedModel

# Package data of the `scenarios` package, so that an installed wheel finds them too.
SCENARIOS_DIR = part_dir("scenarios")
NAME_PATTERN = r"^[a-z0-9-]+$"
NAME_MAX_LENGTH = 64
MAX_YAML_DEPTH = 32  # as JSON bodies (server/guards.py); a scenario nests 4 deep
# The planned work of one scenario, bounded before anything is built. Drawing prompts costs ~6 us a token
# (1,000 prompts x 10,000 tokens planned for 61 s inside one request); a run holds a core until its
# tokens are generated; every engine iteration records ~0.5 KB of events with the run's trace, even when
# no request has arrived yet (a request at step 1,000,000 meant 480 MB of empty iterations).
MAX_DRAWN_TOKENS = 250_000
MAX_OUTPUT_TOKENS = 1_000_000
MAX_ARRIVAL_STEP = 20_000


class ScenarioError(KvscopeError):
    """A scenario that cannot be used: the message names the file, the field and the reason."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


@dataclass(frozen=True)
class PlannedWork:
    """What planning a scenario draws from the prompt pool, and the most its run may generate."""

    drawn_tokens: int = 0
    output_tokens: int = 0

    def __add__(self, other: PlannedWork) -> PlannedWork:
        return PlannedWork(self.drawn_tokens + other.drawn_tokens, self.output_tokens + other.output_tokens)

    def check(self) -> None:
        if self.drawn_tokens > MAX_DRAWN_TOKENS:
            raise ValueError(f"{self.drawn_tokens} prompt tokens to draw from the pool (prompt_tokens, count x "
                             f"prompt_tokens.max, shared_prefix.tokens); a scenario draws at most {MAX_DRAWN_TOKENS}")
        if self.output_tokens > MAX_OUTPUT_TOKENS:
            raise ValueError(f"up to {self.output_tokens} tokens to generate (max_tokens, count x max_tokens.max, "
                             f"each x sampling.n or beam_width); a scenario generates at most {MAX_OUTPUT_TOKENS}")


class ChatMessage(_Strict):
    role: str = Field(min_length=1, max_length=32, description="system, user, assistant, ...")
    content: str = Field(max_length=100_000)


class RequestSpec(_Strict):
    id: str = Field(min_length=1, max_length=64)
    arrival_step: int = Field(default=0, ge=0, le=MAX_ARRIVAL_STEP)
    prompt: str | None = Field(default=None, max_length=200_000)
    prompt_tokens: int | None = Field(default=None, ge=1, le=100_000, description="drawn from the prompt pool")
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=64,
                                               description="a chat, written with the model's chat template")
    max_tokens: int = Field(default=32, ge=1, le=100_000)
    sampling: SamplingParams = Field(default_factory=SamplingParams)

    def work(self) -> PlannedWork:
        return PlannedWork(self.prompt_tokens or 0, self.max_tokens * self.sampling.sequences)

    @model_validator(mode="after")
    def _one_prompt(self) -> "RequestSpec":
        if sum(x is not None for x in (self.prompt, self.prompt_tokens, self.messages)) != 1:
            raise ValueError("give exactly one of prompt, prompt_tokens and messages")
        return self


class IntRange(_Strict):
    min: int = Field(ge=1, le=100_000)
    max: int = Field(ge=1, le=100_000)

    @model_validator(mode="after")
    def _ordered(self) -> "IntRange":
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is larger than max ({self.max})")
        return self


class Arrival(_Strict):
    process: Literal["poisson", "uniform", "burst"] = "poisson"
    rate_per_step: float = Field(default=0.5, ge=0.001, le=1000)


class SharedPrefix(_Strict):
    tokens: int = Field(ge=1, le=100_000)
    fraction: float = Field(default=1.0, ge=0.0, le=1.0)


class GenerateSpec(_Strict):
    count: int = Field(ge=1, le=10_000)
    arrival: Arrival = Field(default_factory=Arrival)
    prompt_tokens: IntRange = Field(default_factory=lambda: IntRange(min=16, max=128))
    max_tokens: IntRange = Field(default_factory=lambda: IntRange(min=8, max=64))
    shared_prefix: SharedPrefix | None = None
    sampling: SamplingParams = Field(default_factory=lambda: SamplingParams(temperature=0.0))

    def work(self) -> PlannedWork:
        prefix = self.shared_prefix.tokens if self.shared_prefix else 0
        return PlannedWork(self.count * self.prompt_tokens.max + prefix,
                           self.count * self.max_tokens.max * self.sampling.sequences)

    @model_validator(mode="after")
    def _arrivals_bounded(self) -> "GenerateSpec":
        """The arrivals' expected span (exact for uniform) within MAX_ARRIVAL_STEP, like explicit arrival steps."""
        span = 0.0 if self.arrival.process == "burst" else (self.count - 1) / self.arrival.rate_per_step
        if span > MAX_ARRIVAL_STEP:
            raise ValueError(f"{self.count} requests at arrival.rate_per_step={self.arrival.rate_per_step:g} arrive "
                             f"over ~{span:.0f} engine steps; at most {MAX_ARRIVAL_STEP} (raise the rate or lower "
                             "count)")
        return self


class Ask(_Strict):
    """A question the step asks the room (backend/events/questions.py), revealed at its moment's step."""

    question: QuestionKind
    text: str | None = Field(default=None, min_length=1, max_length=300, description="wording; default: the kind's")


# `{name}` in a lesson text: a value of the run it is shown beside (side by side, each column's own; the
# values: frontend/lesson_text.py; docs/scenarios.md)
PLACEHOLDER = r"\{([A-Za-z0-9_]+)\}"
LESSON_FIELDS = ("model", "attention", "n_layers", "n_heads", "n_kv_heads", "head_dim", "kv_shape", "kv_dtype",
                 "kv_bytes_per_token", "bytes_per_block", "block_size", "num_blocks", "batching", "kv_layout",
                 "kv_cache", "prefix_caching", "chunked_prefill", "token_budget", "arrival_rate", "speculative",
                 "weights_mib", "ranks", "batch_invariant", "hidden_size", "instances")


class LessonStep(_Strict):
    """One step of a lesson: shown at the run's start, or when lesson mode pauses at a key moment."""

    at: Literal["start"] | MomentKind = "start"
    text: str = Field(min_length=1, max_length=1000)
    views: list[ViewName] = Field(default_factory=list, max_length=4,
                                  description="the views the text talks about, in its order; default: the moment's")
    ask: Ask | None = None

    @field_validator("text")
    @classmethod
    def _known_placeholders(cls, text: str) -> str:
        for name in re.findall(PLACEHOLDER, text):
            if name not in LESSON_FIELDS:
                raise ValueError(f"unknown placeholder {{{name}}}; valid: {', '.join(LESSON_FIELDS)}")
        return text


class SimulateSpec(_Strict):
    """Simulate mode (docs/perf_model.md): a model shape on a GPU type, each iteration priced, no weights run."""

    model_shape: str = Field(description="a shape of backend/perf/shapes.py, e.g. llama-3-8b")
    hardware: str = Field(default="h100", description="a GPU profile of backend/perf/hardware.py, or this-machine")
    tp: Literal[1, 2, 4, 8] = Field(default=1, description="tensor-parallel GPUs")
    link: str | None = Field(default=None, description="replace the GPUs' link (nvlink4, nvlink3, pcie5, pcie4)")
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0,
                                          description="share of GPU memory for weights plus the KV pool")

    @field_validator("model_shape")
    @classmethod
    def _known_shape(cls, value: str) -> str:
        return _known(value, sorted(SHAPES))

    @field_validator("hardware")
    @classmethod
    def _known_hardware(cls, value: str) -> str:
        return _known(value, HARDWARE_NAMES)

    @field_validator("link")
    @classmethod
    def _known_link(cls, value: str | None) -> str | None:
        return value if value is None else _known(value, list(LINKS))


def _known(name: str, valid: list[str]) -> str:
    if name not in valid:
        raise ValueError(f"unknown name {name!r}; valid: {', '.join(valid)}")
    return name


class Scenario(_Strict):
    name: str = Field(pattern=NAME_PATTERN, max_length=NAME_MAX_LENGTH)
    description: str = ""
    lesson: list[LessonStep] = Field(default_factory=list, description="what to look at while it runs")
    model: str = "demo"
    fallback_model: str | None = Field(default=None, description="a shipped model to run instead when `model` needs "
                                                                   "a package that is not installed (resolved at load: "
                                                                   "`model` then names the one that runs)")
    seed: int = Field(default=0, ge=0, lt=2**32)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    requests: list[RequestSpec] = Field(default_factory=list, max_length=10_000)
    generate: GenerateSpec | None = None
    simulate: SimulateSpec | None = Field(default=None, description="run on a model shape and GPU, in modelled time")

    @field_validator("lesson", mode="before")
    @classmethod
    def _text_is_one_step(cls, value: Any) -> Any:
        """A lesson written as plain text (older scenario files) is one step at the start."""
        if isinstance(value, str):
            return [{"at": "start", "text": value}] if value.strip() else []
        return value

    @field_validator("lesson")
    @classmethod
    def _asked_before_revealed(cls, lesson: list[LessonStep]) -> list[LessonStep]:
        """A question is answered at its moment's step; the lesson pauses after a moment, so it is asked earlier."""
        for i, step in enumerate(lesson):
            reveal = QUESTIONS[step.ask.question].reveal if step.ask else None
            if reveal is not None and all(later.at != reveal for later in lesson[i + 1:]):
                raise ValueError(f"step {i}'s ask.question ({step.ask.question}) is revealed at the lesson's `{reveal}` "
                                 f"step, and no step after it is at {reveal}")
        return lesson

    @field_validator("requests")
    @classmethod
    def _requests_bounded(cls, requests: list[RequestSpec]) -> list[RequestSpec]:
        sum((r.work() for r in requests), PlannedWork()).check()
        return requests

    @field_validator("generate")
    @classmethod
    def _generate_bounded(cls, generate: GenerateSpec | None, info: ValidationInfo) -> GenerateSpec | None:
        """Together with the explicit requests (validated before: they come first)."""
        if generate is not None:
            sum((r.work() for r in info.data.get("requests") or []), generate.work()).check()
        return generate

    @model_validator(mode="after")
    def _has_requests(self) -> "Scenario":
        if not self.requests and self.generate is None:
            raise ValueError("a scenario needs requests or generate")
        ids = [r.id for r in self.requests]
        if len(ids) != len(set(ids)):
            raise ValueError("request ids must be unique")
        return self

    @model_validator(mode="after")
    def _ranks_are_real(self) -> "Scenario":
        if self.simulate is not None and self.engine.tensor_parallel > 1:  # simulate has no processes to spawn
            raise ValueError("engine.tensor_parallel starts real ranks; a simulated run prices them with simulate.tp "
                             "(--tp)")
        return self

    @field_validator("fallback_model")
    @classmethod
    def _shipped_fallback(cls, name: str | None) -> str | None:
        """A shipped model, so that the fallback itself is always there."""
        return name if name is None else _known(name, list(SHIPPED_MODELS))

    @model_validator(mode="after")
    def _fall_back_when_not_installed(self) -> "Scenario":
        """A lesson written for a real model runs on it where it is installed, else on the fallback (the demo)."""
        if self.fallback_model is not None and missing_package(self.model) is not None:
            self.model = self.fallback_model
        return self

    def models(self) -> list[str]:
        """The models a run loads: its own, and a speculative draft model."""
        spec = self.engine.speculative
        return [self.model] + ([spec.draft_model] if spec is not None and spec.method == "draft" else [])

    def unavailable(self) -> str | None:
        """Why it cannot run here (a model whose package is not installed, with the command), or None."""
        for model in self.models():
            command = missing_package(model)
            if command is not None:
                return f"model {model} is not installed (run: {command})"
        return None


def check_available(scenario: Scenario) -> None:
    """A ScenarioError saying how to install what the scenario needs, when it cannot run here."""
    reason = scenario.unavailable()
    if reason is not None:
        raise ScenarioError(str(scenario.name), str(reason))


@dataclass
class PlannedRequest:
    """A concrete request of a run: what arrives, and when."""

    request_id: str
    arrival_step: int
    prompt: str | list[int]
    max_tokens: int
    sampling: SamplingParams


# ---- loading -----------------------------------------------------------------------------------


def resolve_path(name_or_path: str) -> Path:
    """A file path, or the name of a file in scenarios/ (names cannot reach outside it)."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or _exists(path):
        if not path.is_file():
            raise ScenarioError(str(path), "no such scenario file")
        return path
    if not re.match(NAME_PATTERN, name_or_path):
        raise ScenarioError(f"{name_or_path!r}", "not a scenario name (use [a-z0-9-]+) or a .yaml file")
    bundled = bundled_path(name_or_path)
    if bundled is None:
        raise ScenarioError(str(name_or_path)[:NAME_MAX_LENGTH], "no such scenario (`kvscope scenarios` lists them)")
    return bundled


def bundled_path(name: str) -> Path | None:
    """The bundled scenario of this name, if there is one (a name no scenario could have is none)."""
    if len(name) > NAME_MAX_LENGTH or not re.match(NAME_PATTERN, name):
        return None
    path = SCENARIOS_DIR / f"{name}.yaml"
    return path if path.is_file() else None


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name too long for the file system is no file on it
        return False


def parse_assignment(assignment: str) -> tuple[str, Any]:
    """One `--set a.b.c=VALUE` as (dotted key, VALUE parsed as YAML)."""
    key, sep, raw = assignment.partition("=")
    if not sep:
        raise ScenarioError(f"--set {assignment!r}", "expected KEY=VALUE, e.g. engine.block_size=8")
    try:
        return key, safe_load(raw)
    except yaml.YAMLError as e:
        raise ScenarioError(f"--set {assignment}", f"the value is not valid YAML ({getattr(e, 'problem', e)})") from None


def apply_overrides(data: dict[str, Any], overrides: list[tuple[str, Any, str]]) -> dict[str, str]:
    """Set each (dotted key, value, label) in a raw scenario dict; returns key -> label, for validate."""
    for key, value, label in overrides:
        if "" in key.split("."):
            raise ScenarioError(str(label), f"{key!r} is not a dotted field path, e.g. engine.block_size")
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ScenarioError(str(label), f"{part} is not a section")
        node[leaf] = value
    return {key: label for key, _, label in overrides}


def validate(data: Any, source: str, blame: dict[str, str] | None = None) -> Scenario:
    """The scenario, or a ScenarioError naming the override (blame: dotted key -> label) or the source."""
    _require_mapping(data, source)
    try:
        return Scenario.model_validate(data)
    except ValidationError as e:
        raise ScenarioError(*_describe(e.errors()[0], source, blame or {})) from None


def _require_mapping(data: Any, source: str) -> None:
    if not isinstance(data, dict):
        raise ScenarioError(str(source), "a scenario is a YAML mapping")


def _describe(err: Any, source: str, blame: dict[str, str]) -> tuple[str, str]:
    """One validation error as (where, reason), where = the override that caused it, else source: field."""
    loc = tuple(str(p) for p in err["loc"])
    reason = _unknown_field(loc) if err["type"] == "extra_forbidden" else pydantic_reason(err["msg"])
    for key, label in reversed(blame.items()):
        parts = tuple(key.split("."))
        if loc[: len(parts)] == parts:  # inside the value the override set
            rest = ".".join(loc[len(parts):])
            return (f"{label}: {rest}", reason) if rest else (label, reason)
        if loc and parts[: len(loc)] == loc:  # a check of the section the override changed
            return label, reason
    return f"{source}: {'.'.join(loc) or 'scenario'}", reason


def _unknown_field(loc: tuple[str, ...]) -> str:
    """'unknown field', with the closest valid field of the same section when one is close."""
    model = _model_at(loc[:-1])
    if model is None:
        return "unknown field"
    fields = list(model.model_fields)
    close = difflib.get_close_matches(loc[-1], fields, n=1)
    if close:
        return f"unknown field; did you mean {'.'.join((*loc[:-1], close[0]))}?"
    return f"unknown field (expected one of: {', '.join(fields)})"


def _model_at(loc: tuple[str, ...]) -> type[BaseModel] | None:
    """The pydantic model of the section at loc (list indices skipped), or None."""
    model: type[BaseModel] | None = Scenario
    for part in loc:
        if part.isdigit():
            continue
        field = model.model_fields.get(part)
        model = _model_in(field.annotation) if field else None
        if model is None:
            return None
    return model


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model in `M`, `M | None` or `list[M]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_model_in, get_args(annotation)) if m is not None), None)


class YAMLTooDeep(yaml.MarkedYAMLError):
    """Collections nested deeper than MAX_YAML_DEPTH."""


def safe_load(text: str) -> Any:
    """yaml.safe_load, refusing collections nested deeper than MAX_YAML_DEPTH first (YAMLTooDeep).

    Building the data recurses once per level (2,000 levels ran out of Python's stack: a 500); the
    parser's events, counted here, come from a state machine that does not."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_YAML_DEPTH:
                raise YAMLTooDeep(problem=f"nested deeper than {MAX_YAML_DEPTH} levels",
                                  problem_mark=event.start_mark)
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
    return yaml.safe_load(text)


def read_yaml(path: Path) -> Any:
    """A YAML file's data; a syntax error is one line, `file:line:col: problem`."""
    try:
        return safe_load(path.read_text(encoding="utf-8"))
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ScenarioError(str(where), f"{e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ScenarioError(str(path), f"not valid YAML ({' '.join(str(e).split())})") from None
    except UnicodeDecodeError:
        raise ScenarioError(str(path), "not UTF-8 text") from None
    except OSError as e:
        raise ScenarioError(str(path), f"cannot read ({e.strerror})") from None


def load_scenario(name_or_path: str, overrides: list[str] = (),
                  flags: list[tuple[str, Any, str]] = ()) -> Scenario:
    """A scenario file (or bundled name) with `--set KEY=VALUE` overrides, then flags' (key, value, label), validated."""
    path = resolve_path(name_or_path)
    data = read_yaml(path)
    _require_mapping(data, str(path))
    blame = apply_overrides(data, [(*parse_assignment(a), f"--set {a}") for a in overrides] + list(flags))
    return validate(data, str(path), blame)


def list_scenarios() -> list[Scenario]:
    return [load_scenario(str(p)) for p in sorted(SCENARIOS_DIR.glob("*.yaml"))]


# ---- expansion into requests --------------------------------------------------------------------


@lru_cache(maxsize=1)
def _pool_text() -> str:
    return read_corpus()[1]


def draw_prompt(tokenizer: Tokenizer, num_tokens: int, rng: random.Random) -> list[int]:
    """num_tokens consecutive tokens from a seeded place in the prompt pool."""
    text = _pool_text()
    for _ in range(100):
        start = rng.randrange(0, max(1, len(text) - 8 * num_tokens))
        ids = tokenizer.encode(text[start : start + 8 * num_tokens + 64])
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
    raise ScenarioError("prompt_tokens", f"cannot draw {num_tokens} tokens from the prompt pool")


def plan_requests(scenario: Scenario, loaded: LoadedModel) -> list[PlannedRequest]:
    """Every request of the scenario, explicit and generated, in arrival order (deterministic)."""
    rng = random.Random(scenario.seed)
    planned = [PlannedRequest(r.id, r.arrival_step, _prompt(r, loaded, rng), r.max_tokens, r.sampling)
               for r in scenario.requests]
    if scenario.generate:
        planned += _generated(scenario.generate, loaded.tokenizer, rng)
    return sorted(planned, key=lambda p: p.arrival_step)


def _prompt(r: RequestSpec, loaded: LoadedModel, rng: random.Random) -> str | list[int]:
    """An explicit request's prompt: as written, drawn from the pool, or its chat in the model's template."""
    if r.messages is not None:
        return encode_chat([m.model_dump() for m in r.messages], loaded)
    return r.prompt if r.prompt is not None else draw_prompt(loaded.tokenizer, r.prompt_tokens, rng)


def _generated(g: GenerateSpec, tokenizer: Tokenizer, rng: random.Random) -> list[PlannedRequest]:
    prefix = draw_prompt(tokenizer, g.shared_prefix.tokens, rng) if g.shared_prefix else []
    out, clock = [], 0.0
    for i in range(g.count):
        own = draw_prompt(tokenizer, rng.randint(g.prompt_tokens.min, g.prompt_tokens.max), rng)
        shares = g.shared_prefix is not None and rng.random() < g.shared_prefix.fraction
        seed = g.sampling.seed
        sampling = g.sampling.model_copy(update={"seed": (seed + i) % 2**63}) if seed is not None else g.sampling
        out.append(PlannedRequest(f"g{i}", int(clock), (prefix if shares else []) + own,
                                  rng.randint(g.max_tokens.min, g.max_tokens.max), sampling))
        clock += _gap(g.arrival, rng)
    return out


def _gap(arrival: Arrival, rng: random.Random) -> float:
    """Steps until the next arrival."""
    if arrival.process == "poisson":
        return rng.expovariate(arrival.rate_per_step)
    if arrival.process == "uniform":
        return 1.0 / arrival.rate_per_step
    return 0.0  # burst: everything at step 0
