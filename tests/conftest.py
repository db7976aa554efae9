"""Shared fixtures: models are loaded once per session (importing and loading takes seconds)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run (CI must not meet a new example by chance, on
# the submitting machine, on the day it decides), and no example has a time limit (hypothesis's
# 200 ms deadline is a wall-clock bound that a loaded machine breaks). `pytest --hypothesis-profile
# explore` draws new examples, to look for cases the fixed ones miss.
settings.register_profile("deterministic", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile("deterministic")

from kvscope.backend.model.loader import LoadedModel, load_model


@pytest.fixture(scope="session", autouse=True)
def own_data_folder(tmp_path_factory):
    """`kvscope serve` (run by tests as a subprocess) saves finished runs under $XDG_DATA_HOME: never the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("data")))
        yield


@pytest.fixture(scope="session")
def demo() -> LoadedModel:
    return load_model("demo")


@pytest.fixture(scope="session")
def draft() -> LoadedModel:
    return load_model("demo-draft")


@pytest.fixture(scope="session")
def workload(demo: LoadedModel) -> list:
    """16 requests of different lengths and arrival steps on the demo model (tests/engine_helpers.py)."""
    from tests.engine_helpers import mixed_workload

    return mixed_workload(demo, count=16)


@pytest.fixture(scope="session")
def expected(demo: LoadedModel, workload: list) -> dict[str, list[int]]:
    """The plain reference model's greedy output for each request of `workload`, computed alone."""
    from kvscope.backend.engine.reference import reference_generate
    from tests.engine_helpers import GREEDY

    eos = demo.tokenizer.eos_token_ids
    return {rid: reference_generate(demo.model, prompt, max_tokens, GREEDY, eos)
            for rid, _, prompt, max_tokens in workload}


def make_tiny_model(n_kv_heads: int = 2, seed: int = 0, mla: bool = False) -> LoadedModel:
    """A small random decoder with the shipped tokenizer: fast, and with peaked, varied logits."""
    from pathlib import Path

    from kvscope.backend.config import MLAConfig, ModelConfig
    from kvscope.backend.model.loader import SHIPPED_MODELS_DIR
    from kvscope.backend.model.tokenizer import Tokenizer
    from kvscope.backend.model.transformer import CausalLM

    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=2048, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=n_kv_heads, head_dim=16,
                      max_position_embeddings=1024, eos_token_id=0,
                      mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
                      if mla else None)
    model = CausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(10.0)  # std 0.2: far from uniform, so greedy ties never happen
    tok = Tokenizer.from_file(SHIPPED_MODELS_DIR / "tokenizer.json")
    return LoadedModel("tiny", Path("."), cfg, model, tok)


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return make_tiny_model()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tiny) -> str:
    """The tiny model saved as a model folder, for scenarios and servers (`model: <folder>`)."""
    from kvscope.backend.model.loader import save_model

    folder = tmp_path_factory.mktemp("tiny-model")
    save_model(tiny.model, tiny.tokenizer, folder)
    return str(folder)
