"""Per-request sampling settings, validated at the edge (scenario files, API bodies, CLI)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    """How one request picks its tokens. temperature 0 means greedy."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_k: int = Field(default=0, ge=0, description="keep the k most likely tokens; 0 = off")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="keep the smallest set with this mass")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="drop tokens below min_p x the top probability")
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    n: int = Field(default=1, ge=1, le=16)
    beam_width: int = Field(default=0, ge=0, le=16)
    length_penalty: float = Field(default=1.0, ge=-10.0, le=10.0)
    stop: list[str] = Field(default_factory=list, max_length=8)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    ignore_eos: bool = False
    logprobs: int = Field(default=0, ge=0, le=20, description="top alternatives reported per token")
    # The seeds' point: truncating EOS away means generation cannot stop by itself. This exemption is
    # kvscope's own (transformers and vLLM have none): truncate_eos: true gives their behaviour.
    truncate_eos: bool = Field(default=False, description="allow top-k/top-p/min-p to remove EOS")
    # Applied to the logits before everything else (ids are checked against the vocabulary by the engine).
    logit_bias: dict[int, Annotated[float, Field(ge=-100.0, le=100.0)]] = Field(
        default_factory=dict, max_length=1024, description="token id -> added to its logit")
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1, max_length=65536,
                                                description="only these tokens may be chosen; None = all")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
