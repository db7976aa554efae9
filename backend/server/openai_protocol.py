"""The bodies of OpenAI's completion and chat routes (and what the Responses and tokenize routes share).

OpenAI's fields that kvscope implements, or that cannot change the output (ids for OpenAI's records);
any other field is refused with a 400 naming it, never silently ignored (`extra="forbid"`, and
`refuse_unimplemented` for values it cannot honour). A null counts as absent. Every size is bounded
here, before anything is tokenized or loaded.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidatorFunctionWrapHandler, field_validator,
                      model_validator)

from kvscope.backend.engine.sampling_params import MAX_STOP_CHARS, MAX_STOPS, StopString
from kvscope.backend.server.openai_errors import OpenAIError
from kvscope.backend.server.structured import (ChoiceList, GrammarText, ResponseFormat, Schema,
                                               StructuredOutputsField)
from kvscope.backend.server.tools import ToolCall, ToolChoice, Tools

MAX_PROMPT_CHARS = 100_000
MAX_PROMPT_TOKENS = 100_000
MAX_PROMPTS = 64
MAX_CHOICES = 64  # prompts x n
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
TokenIds = Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKENS)]
Text = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
Name = Annotated[str, Field(max_length=256)]


class StrictBody(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None or k in cls.model_fields} \
            if isinstance(data, dict) else data


class StreamOptions(StrictBody):
    """`stream_options` as the chat, completion and Responses routes take it; each refuses by name the fields
    it does not honour (`refuse`), as it refuses a field no body declares."""

    # chat and completions: a last chunk with the usage, the chunks before it carrying `usage: null`; the
    # Responses API's final event always has the usage (benchmark tools send it: aiperf)
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's (chat, completions): with include_usage, every chunk's
    include_obfuscation: bool | None = None  # the Responses API's: kvscope pads no stream event, so only false

    def refuse(self, *fields: str) -> None:
        """400 naming the first of these fields that is present."""
        for name in fields:
            if getattr(self, name) is not None:
                raise OpenAIError(400, f"stream_options.{name}: not supported by kvscope", f"stream_options.{name}")


class SamplingBody(StrictBody):
    """The fields the completion and chat bodies share: the model, sampling, stops, streaming and the grammar
    fields (OpenAI's response_format; vLLM's structured_outputs and guided_*, which it takes on both routes)."""

    model: Name | None = None
    max_tokens: int | None = Field(default=None, ge=0, le=100_000)
    temperature: float | None = None  # bounds: SamplingParams, the engine's one definition of them
    top_p: float | None = None
    top_k: int | None = Field(default=None, ge=0, lt=2**31)
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool | None = None  # vLLM's extras, handy to watch a long generation
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=64)
    n: int | None = Field(default=None, ge=1, le=16)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = None
    logit_bias: dict[TokenId, Annotated[float, Field(ge=-100, le=100)]] | None = Field(default=None, max_length=1024)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Name | None = None  # an end user's id, for OpenAI's abuse monitoring: nothing to act on here
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None  # vLLM's grammar fields: structured.py
    guided_json: Schema | None = None
    guided_regex: GrammarText | None = None
    guided_choice: ChoiceList | None = None
    guided_grammar: GrammarText | None = None

    @field_validator("stop", mode="wrap")
    @classmethod
    def _stop_strings(cls, stop: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(stop)
        except ValidationError:  # pydantic's message names a branch of the union: say what is expected
            raise ValueError(f"a string or a list of up to {MAX_STOPS}, each of 1..{MAX_STOP_CHARS} characters "
                             "(an empty one would end every answer before it starts)") from None

    def refuse_unimplemented(self) -> None:
        """400 for a value kvscope cannot honour (fields it does not know at all fail validation)."""
        if self.stream_options is None:
            return
        self.stream_options.refuse("include_obfuscation")
        if not self.stream:
            raise OpenAIError(400, "stream_options: only allowed when stream is true", "stream_options")


class CompletionBody(SamplingBody):
    prompt: Text | TokenIds | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)] \
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = None
    best_of: int | None = Field(default=None, ge=1, le=16)
    suffix: Text | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_shape(cls, prompt: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(prompt)
        except ValidationError:  # pydantic's message names a branch of the union: say what is expected
            raise ValueError(f"a string or a list of token ids (up to {MAX_PROMPT_CHARS} characters or "
                             f"{MAX_PROMPT_TOKENS} ids), or a list of up to {MAX_PROMPTS} of one of these") from None

    def refuse_unimplemented(self) -> None:
        super().refuse_unimplemented()
        if self.suffix:
            raise OpenAIError(400, "suffix: not supported by kvscope (it does not insert text)", "suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise OpenAIError(400, "best_of: kvscope returns every sample it draws; best_of must equal n",
                              "best_of")
        if self.max_tokens == 0 and not self.echo:
            raise OpenAIError(400, "max_tokens: must be at least 1 (0 only with echo)", "max_tokens")

    def prompts(self) -> list[str | list[int]]:
        """The batch: one string or token-id list per prompt."""
        p = self.prompt
        return [p] if isinstance(p, str) or not p or isinstance(p[0], int) else list(p)


class ContentPart(StrictBody):
    type: Annotated[str, Field(max_length=32)]
    text: Text | None = None
    # Parts kvscope's text-only models cannot read: declared so that they are refused by name
    # (message_dicts), not as fields the body does not know.
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


UNREADABLE_PARTS = {"image_url": "images are not supported by this model",
                    "input_audio": "audio is not supported by this model",
                    "file": "files are not supported by this model"}
# The roles OpenAI's chat API defines; "developer" is its newer name for "system" and reaches the template as that.
Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(StrictBody):
    role: Role
    content: Text | Annotated[list[ContentPart], Field(max_length=64)] | None = None
    name: Name | None = None
    refusal: Text | None = None  # as the client echoes an earlier answer back
    tool_calls: Annotated[list[ToolCall], Field(max_length=64)] | None = None  # an earlier answer's calls
    tool_call_id: Name | None = None  # a tool message: the call it answers


class ChatBody(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=100_000)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[Annotated[str, Field(max_length=16)]] | None = Field(default=None, max_length=4)
    store: bool | None = None
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = \
        Field(default=None, max_length=16)  # only kept with store, which kvscope refuses
    service_tier: Annotated[str, Field(max_length=32)] | None = None
    safety_identifier: Name | None = None
    prompt_cache_key: Name | None = None  # kvscope's prefix cache needs no hint

    def refuse_unimplemented(self) -> None:
        super().refuse_unimplemented()
        if self.max_tokens == 0:
            raise OpenAIError(400, "max_tokens: must be at least 1", "max_tokens")
        refused = {"modalities": self.modalities not in (None, ["text"]),
                   "store": bool(self.store),
                   "service_tier": self.service_tier not in (None, "auto", "default")}
        for param, is_refused in refused.items():
            if is_refused:
                raise OpenAIError(400, f"{param}: {getattr(self, param)!r} is not supported by kvscope", param)
