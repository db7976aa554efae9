"""Beam search returns the n best hypotheses transformers' `generate` returns, scores included.

transformers stops when `num_beams` hypotheses are done only with early_stopping=True (its
default searches on), and both score log-prob / length ** length_penalty with EOS in the length.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvscope.backend.config import EngineConfig  # noqa: E402
from kvscope.backend.engine.engine import Engine  # noqa: E402
from kvscope.backend.engine.sampling_params import SamplingParams  # noqa: E402
from kvscope.backend.model.loader import SHIPPED_MODELS_DIR  # noqa: E402

PROMPTS = {"eos": ("ROMEO:\nI will", 8), "long": ("First Citizen:\nWe are", 12)}


@pytest.fixture(scope="module")
def hf():
    return transformers.LlamaForCausalLM.from_pretrained(SHIPPED_MODELS_DIR / "demo", dtype=torch.float32).eval()


def hf_beams(hf, prompt: list[int], width: int, max_tokens: int, lp: float, eos: int) -> list[tuple[list[int], float]]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, early_stopping=True,
                          length_penalty=lp, max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos,
                          pad_token_id=eos, output_scores=True, return_dict_in_generate=True)
    beams = []
    for seq, score in zip(out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist(), strict=True):
        beams.append((seq[:seq.index(eos) + 1] if eos in seq else seq, score))
    return beams


def ours(demo, prompt: list[int], width: int, max_tokens: int, lp: float) -> list[tuple[list[int], float]]:
    engine = Engine(demo, EngineConfig(block_size=4, num_blocks=400, max_num_seqs=32, events="off"))
    req = engine.add_request("b", prompt, max_tokens, SamplingParams(beam_width=width, n=width, length_penalty=lp))
    while engine.has_unfinished():
        engine.step()
    return [(o["output_token_ids"], o["score"]) for o in req.outputs]


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("lp", [-1.0, 0.0, 1.0, 2.0])
@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_n_best_equals_transformers_generate(demo, hf, width, lp, prompt):
    text, max_tokens = PROMPTS[prompt]
    ids = demo.tokenizer.encode(text)
    expected = hf_beams(hf, ids, width, max_tokens, lp, demo.tokenizer.eos_token_ids[0])
    got = ours(demo, ids, width, max_tokens, lp)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    assert [score for _, score in got] == pytest.approx([score for _, score in expected], abs=1e-4)


def test_beams_at_max_tokens_are_all_hypotheses(demo, hf):
    """The issue's case: n = 2 at the length limit returned an EOS hypothesis in place of the second beam."""
    ids = demo.tokenizer.encode("First Citizen:\nWe are")
    got = ours(demo, ids, 2, 40, 2.0)
    assert [len(tokens) for tokens, _ in got] == [40, 40]
    assert [s for _, s in got] == pytest.approx([s for _, s in hf_beams(hf, ids, 2, 40, 2.0, 0)], abs=1e-4)
