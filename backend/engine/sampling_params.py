"""Per-request sampling settings, validated at the edge (scenario files, API bodies, CLI)."""

from __future__ import annotations

import json
import warnings
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# vLLM's _SAMPLING_EPS: below it the logits / T overflow float32 (1e-300 made every logit ±inf and the
# softmax NaN, which drew garbage), and the distribution is one-hot on the argmax long before anyway.
GREEDY_BELOW = 1e-5
MAX_STOPS, MAX_STOP_CHARS = 8, 256
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS,
                                  description="an empty stop string would end every request before its first token")]

# A grammar is compiled on the stepping thread at admission: megabytes of schema would stall every
# other request's step (and xgrammar's compile time grows with it), so sizes are bounded first.
MAX_GRAMMAR_CHARS = 65_536
MAX_CHOICES, MAX_CHOICE_CHARS = 256, 1024
GRAMMAR_FIELDS = ("json", "json_object", "regex", "choice", "grammar")


# vLLM's field name `json` shadows pydantic's deprecated `BaseModel.json()`: on an instance the field wins
# (it lives in the instance's __dict__), so the warning pydantic gives at class creation is only noise.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message='Field name "json"', category=UserWarning)

    class StructuredOutputs(BaseModel):
        """A grammar the output must follow: exactly one field set. vLLM's `StructuredOutputsParams` names."""

        model_config = ConfigDict(extra="forbid")

        json: dict[str, Any] | str | None = Field(default=None, description="a JSON schema (object or its text)")
        json_object: bool = Field(default=False, description="any JSON object")
        regex: str | None = Field(default=None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
        choice: list[Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]] | None = Field(
            default=None, min_length=1, max_length=MAX_CHOICES, description="the output is exactly one of these")
        grammar: str | None = Field(default=None, min_length=1, max_length=MAX_GRAMMAR_CHARS,
                                    description="EBNF in xgrammar's syntax (GBNF-like, a `root` rule)")

        @field_validator("json")
        @classmethod
        def _schema_bounded(cls, schema: dict[str, Any] | str | None) -> dict[str, Any] | str | None:
            if schema is not None and len(schema if isinstance(schema, str) else json_text(schema)) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"the schema is longer than {MAX_GRAMMAR_CHARS} characters")
            return schema

        @model_validator(mode="after")
        def _exactly_one(self) -> "StructuredOutputs":
            chosen = self.chosen_fields
            if len(chosen) != 1:
                raise ValueError(f"set exactly one of {', '.join(GRAMMAR_FIELDS)}; "
                                 f"{'none' if not chosen else ', '.join(chosen)} set")
            return self

        @property
        def chosen_fields(self) -> list[str]:
            return [name for name in GRAMMAR_FIELDS if getattr(self, name) not in (None, False)]

        @property
        def kind(self) -> str:
            """The one field that is set: json | json_object | regex | choice | grammar."""
            return self.chosen_fields[0]


def json_text(value: Any) -> str:
    """A JSON value as compact text: equal schemas share one compiled grammar (key order kept: it orders the output)."""
    return json.dumps(value, separators=(",", ":"))


class SamplingParams(BaseModel):
    """How one request picks its tokens. temperature 0 (or below GREEDY_BELOW) means greedy."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    temperature: float = Field(default=1.0, ge=0.0, le=100.0, description=f"below {GREEDY_BELOW:g}: greedy (0)")
    # At or above the vocabulary it keeps every token, as vLLM and transformers clamp it; the bound keeps it
    # an int32 (2**63 overflowed the sampler's tensor and killed the run's worker).
    top_k: int = Field(default=0, ge=0, lt=2**31, description="keep the k most likely tokens; 0 = off")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="keep the smallest set with this mass")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="drop tokens below min_p x the top probability")
    # Divides positive logits: a divisor near 0 made them inf (and the softmax NaN).
    repetition_penalty: float = Field(default=1.0, ge=0.01, le=10.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    n: int = Field(default=1, ge=1, le=16)
    beam_width: int = Field(default=0, ge=0, le=16)
    length_penalty: float = Field(default=1.0, ge=-10.0, le=10.0)
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOPS)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    ignore_eos: bool = False
    logprobs: int = Field(default=0, ge=0, le=20, description="top alternatives reported per token")
    # The seeds' point: truncating EOS away means generation cannot stop by itself. This exemption is
    # kvscope's own (transformers and vLLM have none): truncate_eos: true gives their behaviour.
    truncate_eos: bool = Field(default=False, description="allow top-k/top-p/min-p to remove EOS")
    # Applied to the logits before everything else. Token ids (here and in stop_token_ids) are checked against
    # the model's vocabulary by the engine, which knows it.
    logit_bias: dict[int, Annotated[float, Field(ge=-100.0, le=100.0)]] = Field(
        default_factory=dict, max_length=1024, description="token id -> added to its logit")
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1, max_length=65536,
                                                description="only these tokens may be chosen; None = all")
    # Applied first of all (grammar.py): masked tokens have probability 0, EOS only where the grammar accepts.
    structured_outputs: StructuredOutputs | None = None

    @field_validator("temperature")
    @classmethod
    def _greedy_below_floor(cls, temperature: float) -> float:
        """A temperature below the floor is greedy, recorded as 0 so that every reader (events, the
        dashboard's sampling view) sees what was done."""
        return 0.0 if temperature < GREEDY_BELOW else temperature

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def sequences(self) -> int:
        """How many sequences a request with these settings runs at once (n, or the beams)."""
        return max(self.n, self.beam_width)
