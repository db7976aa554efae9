"""A sequence's text, decoded as its tokens come: the pieces add up to the whole decode, a stop string is
never handed out (nor anything after it), and what might still start one waits. Through the engine, each
token's text delta adds up to the output text its request returns, for every sequence of an n > 1 request."""

from __future__ import annotations

import random

import pytest

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.detokenizer import IncrementalText
from kvscope.backend.engine.engine import Engine
from kvscope.backend.engine.request_output import Finished, Token


def test_the_pieces_add_up_to_the_whole_decode(demo):
    tok = demo.tokenizer
    plain = [t for t in range(tok.vocab_size) if t not in tok.special_ids]
    for seed in range(20):
        ids = random.Random(seed).choices(plain, k=60)
        text = IncrementalText(tok, [])
        sent = "".join(text.push(t) for t in ids)
        whole = tok.decode(ids)
        assert text.pending == "" and whole.startswith(sent)  # no stop string: nothing waits
        assert set(whole[len(sent):]) <= {"\ufffd"}  # but an unfinished character at the end is no text yet


def test_a_stop_string_is_cut_with_everything_after_it_and_never_handed_out(demo):
    tok = demo.tokenizer
    ids = tok.encode("Good morrow, my lord. STOP the rest is silence")
    text = IncrementalText(tok, ["STOP"])
    pieces = []
    for t in ids:
        pieces.append(text.push(t))
        if text.stopped:
            break
    assert text.stopped and "".join(pieces) == text.text() == "Good morrow, my lord. "
    assert all("S" not in p for p in pieces)  # the stop string's start waited until the cut was known


def test_what_could_start_a_stop_string_waits_and_is_released_when_it_does_not(demo):
    tok = demo.tokenizer
    text = IncrementalText(tok, ["lord!"])  # five characters: the last four wait
    sent = "".join(text.push(t) for t in tok.encode("my lord, my liege"))
    assert not text.stopped and sent + text.pending == "my lord, my liege" and len(text.pending) == 4


def test_a_stop_token_keeps_its_text_whole(demo):
    tok = demo.tokenizer
    ids = tok.encode("to be or not")
    text = IncrementalText(tok, ["be"])
    text.push(ids[0])
    assert text.push(ids[1], stop_strings=False) is not None and not text.stopped


@pytest.mark.parametrize("sampling", [{"temperature": 0.0, "stop": ["\n"]},
                                      {"temperature": 1.0, "seed": 3, "n": 3, "stop": [" the", "\n\n"]},
                                      {"temperature": 0.8, "seed": 1}])
def test_the_deltas_of_every_sequence_add_up_to_what_it_returns(demo, sampling):
    engine = Engine(demo, EngineConfig(events="off"))
    outputs: list = []
    engine.stream_outputs(outputs.append)
    engine.add_request("r", "KING HENRY:\n", 48, sampling)
    while engine.has_unfinished():
        engine.step()
    (finished,) = [o for o in outputs if isinstance(o, Finished)]
    for out in finished.outputs:
        sent = "".join(o.text for o in outputs if isinstance(o, Token) and o.seq_id == out["seq_id"])
        assert out["output_text"].startswith(sent)
        if out["finish_reason"] == "stop":  # cut before the stop string: the whole text, nothing held back
            assert sent == out["output_text"] and not any(s in sent for s in sampling["stop"])
        whole = demo.tokenizer.decode([t for t in out["output_token_ids"] if t not in demo.tokenizer.eos_token_ids])
        cut = min([whole.find(s) for s in sampling.get("stop", []) if s in whole] or [len(whole)])
        assert out["output_text"] == whole[:cut]
