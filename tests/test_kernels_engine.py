"""The engine on the Triton kernels (`attention_backend: triton`) gives the torch backend's tokens.

On this CPU the kernels run under TRITON_INTERPRET=1, so the scenario is short: a tiny model, a few
requests of different lengths arriving at different steps, small blocks and a small token budget so
that prefill chunks, decodes and blocks shared by prefix caching all meet in the same iterations.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: no GPU here

import pytest

pytest.importorskip("triton")

import torch

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.engine import Engine, pick_attention_backend
from kvscope.backend.engine.request import RequestError
from tests.conftest import make_tiny_model
from tests.engine_helpers import mixed_workload, outputs, run_engine

def short_workload(loaded, seed: int = 1):
    """Six requests: prompts cut to <= 40 tokens, <= 8 new tokens each; one repeats a prompt."""
    work = [(rid, step, prompt[:40], min(n, 8)) for rid, step, prompt, n in mixed_workload(loaded, 6, seed)]
    rid, step, prompt, n = work[0]
    return work + [("again", step + 3, prompt, n)]


@pytest.mark.parametrize("variant,block_size", [("gqa", 4), ("gqa", 3), ("mqa", 4), ("mla", 4)])
def test_triton_backend_gives_the_torch_backends_greedy_tokens(variant, block_size):
    loaded = make_tiny_model(n_kv_heads=1 if variant == "mqa" else 2, mla=variant == "mla")
    work = short_workload(loaded)
    config = dict(block_size=block_size, num_blocks=128, max_num_batched_tokens=16, device="cpu")
    want = outputs(run_engine(loaded, EngineConfig(attention_backend="torch", **config), work))
    engine = run_engine(loaded, EngineConfig(attention_backend="triton", **config), work)
    assert engine.attention_backend == "triton"
    assert outputs(engine) == want
    assert engine.requests["again"].seq.num_cached_prompt_tokens > 0, "a prefix-cache hit must be exercised"


def test_auto_picks_torch_on_a_cpu():
    assert pick_attention_backend(EngineConfig(), torch.device("cpu")) == "torch"
    assert pick_attention_backend(EngineConfig(attention_backend="triton"), torch.device("cpu")) == "triton"


def test_triton_on_a_cpu_without_the_interpreter_is_refused(tiny, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RequestError) as err:
        Engine(tiny, EngineConfig(attention_backend="triton", device="cpu"))
    assert err.value.field == "engine.attention_backend" and "TRITON_INTERPRET=1" in err.value.reason
