"""The byte-level BPE tokenizer: lossless on any string; EOS between speeches."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.backend.model.loader import SHIPPED_MODELS_DIR
from kvscope.backend.model.tokenizer import EOS_TEXT, Tokenizer, encode_corpus

TOK = Tokenizer.from_file(SHIPPED_MODELS_DIR / "tokenizer.json")


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_decode_of_encode_is_identity_for_any_string(s: str):
    assert TOK.decode(TOK.encode(s)) == s


def test_vocabulary_has_2048_tokens_with_end_of_text_first():
    assert TOK.vocab_size == 2048
    assert TOK.eos_token_ids == [0]
    assert TOK.token_text(0) == EOS_TEXT


def test_end_of_text_separates_speeches():
    ids = encode_corpus(TOK, "ROMEO:\nBut soft!\n\nJULIET:\nAy me.\n")
    text = TOK.decode(ids)
    assert text == f"ROMEO:\nBut soft!\n{EOS_TEXT}JULIET:\nAy me.\n{EOS_TEXT}"
    assert ids.count(0) == 2
