"""The shipped demo models are good enough to teach with, measured on the validation split."""

import json

import pytest

from kvscope.backend.model.loader import SHIPPED_MODELS, SHIPPED_MODELS_DIR, load_model
from kvscope.backend.model.quality import acceptance_rate, bits_per_char, evaluate, validation_windows

MAX_FILE_BYTES = 20 * 1024**2


@pytest.fixture(scope="module")
def val_rows(demo):
    return validation_windows(demo.tokenizer)


def test_demo_reaches_at_most_2_25_bits_per_char_on_validation(demo, val_rows):
    nats = evaluate(demo.model, val_rows)
    assert bits_per_char(nats, val_rows, demo.tokenizer) <= 2.25


def test_draft_acceptance_rate_against_demo_is_at_least_0_6(demo, draft, val_rows):
    assert acceptance_rate(demo.model, draft.model, val_rows[:48]) >= 0.6


@pytest.mark.parametrize("name", SHIPPED_MODELS)
def test_shipped_folders_are_complete_small_and_documented(name):
    folder = SHIPPED_MODELS_DIR / name
    weights = folder / "model.safetensors"
    assert weights.stat().st_size < MAX_FILE_BYTES
    card = (folder / "README.md").read_text()
    metrics = json.loads((folder / "metrics.json").read_text())
    for fact in (str(metrics["steps"]), str(metrics["val_bits_per_char"]), "Sample"):
        assert fact in card
    assert load_model(name).config.architecture == ("KvscopeForCausalLM" if name == "demo-mla" else "LlamaForCausalLM")


def test_variants_share_size_data_steps_and_seed():
    metrics = {n: json.loads((SHIPPED_MODELS_DIR / n / "metrics.json").read_text())
               for n in ("demo", "demo-mha", "demo-mqa", "demo-mla")}
    assert len({(m["steps"], m["batch"], m["seed"]) for m in metrics.values()}) == 1
    attention = {n: load_model(n).config.attention for n in metrics}
    assert attention == {"demo": "gqa", "demo-mha": "mha", "demo-mqa": "mqa", "demo-mla": "mla"}


def test_demo_writes_speeches_and_stops_by_itself(demo):
    from kvscope.backend.engine.sampling_params import SamplingParams
    from kvscope.backend.engine.reference import reference_generate

    prompt = demo.tokenizer.encode("ROMEO:\n")
    eos = demo.tokenizer.eos_token_ids
    speeches = [reference_generate(demo.model, prompt, 200, SamplingParams(temperature=0.8, seed=s), eos)
                for s in range(6)]
    stopped = [out for out in speeches if out[-1] in eos]
    assert len(stopped) >= 5, "the model learned to end its speech"
    assert sum(len(demo.tokenizer.decode(out[:-1]).split()) >= 5 for out in stopped) >= 4
