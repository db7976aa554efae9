"""LoadedModel: a model ready to run, with its name, folder, config and tokenizer.

loader.py builds one (and re-exports the name); quant.py makes quantized copies of one. Apart from
the loader so that quant.py, which the loader reaches through gguf_weights.py, need not import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvscope.backend.config import ModelConfig
from kvscope.backend.model.tokenizer import Tokenizer
from kvscope.backend.model.transformer import CausalLM


@dataclass
class LoadedModel:
    name: str
    path: Path
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    gguf_types: dict[str, int] | None = None  # a GGUF file loaded natively: its tensor types and counts
