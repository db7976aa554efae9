"""Shared fixtures: models are loaded once per session (importing and loading takes seconds)."""

from __future__ import annotations

import os

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

# bench/gpu.py runs the kernels' tests on a GPU this way: their tensors, made without a device, land there
if os.environ.get("KVSCOPE_TEST_DEVICE"):
    torch.set_default_device(os.environ["KVSCOPE_TEST_DEVICE"])

# `python -m pytest -q -m quick`: a first check of the engine's core in a minute or two, where the whole
# default run takes about 20 minutes (docs/testing.md). Files or test ids (a parametrized id's base
# name takes every case). The list is here, in one piece, rather than marks spread over the files: the
# subset is read, timed and changed as a whole.
QUICK = (
    "tests/test_block_manager.py",  # exact block ids, ref counts, prefix sharing, its state machine
    "tests/test_engine_behaviour.py::test_same_scenario_and_seed_give_identical_events",  # the scheduler
    "tests/test_engine_behaviour.py::test_seeded_sampling_gives_the_same_tokens_alone_and_in_any_batch",
    "tests/test_engine_behaviour.py::test_bad_requests_are_refused_with_a_reason_while_others_finish",
    "tests/test_engine_behaviour.py::test_a_sequence_that_outgrows_the_whole_cache_is_aborted_and_the_others_go_on",
    "tests/test_engine_greedy.py::test_engine_greedy_equals_reference[continuous]",  # greedy = the reference
    "tests/test_engine_greedy.py::test_engine_greedy_equals_reference[chunked-budget-7]",
    "tests/test_engine_greedy.py::test_engine_greedy_equals_reference[forced-preemption]",
    "tests/test_sampler.py",
    "tests/test_step_input.py",  # the step as data: ids and ints in, ids out, through pickled copies
    "tests/test_detokenizer.py",  # text deltas and stop strings
    "tests/test_events.py",  # the schema and the reducer
    "tests/test_events_emitted.py::test_every_emitted_event_validates_strictly[plain]",
    "tests/test_events_emitted.py::test_every_emitted_event_validates_strictly[preemption]",
    "tests/test_server.py::test_paused_run_steps_exactly_one_iteration_per_step",  # one server round trip
    "tests/test_no_timed_assertions.py",  # the guards that read the tests' and the engine's source
    "tests/test_one_writer.py",
)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "quick: the first check of the engine's core (tests/conftest.py's QUICK)")


def names(entry: str, nodeid: str) -> bool:
    return nodeid == entry or nodeid.startswith((entry + "::", entry + "["))


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if any(names(entry, item.nodeid) for entry in QUICK):
            item.add_marker(pytest.mark.quick)
    if "quick" not in (config.getoption("markexpr") or ""):
        return
    files = {item.nodeid.split("::")[0] for item in items}
    lost = [entry for entry in QUICK if entry.split("::")[0] in files and not any(names(entry, item.nodeid)
                                                                                  for item in items)]
    if lost:  # a test renamed or removed: the quick subset must not shrink unnoticed
        raise pytest.UsageError(f"tests/conftest.py's QUICK names tests that no longer exist: {lost}")


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
