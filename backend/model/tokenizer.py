"""Tokenizer: a thin wrapper over `tokenizers`, and the byte-level BPE the demo models use.

Byte-level BPE maps every byte to a symbol before merging, so any string round-trips exactly:
decode(encode(s)) == s. The corpus is cut into speeches (blank-line separated in Tiny Shakespeare)
and an end-of-text token is placed between them, so that the models learn to stop on their own.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from tokenizers.decoders import DecodeStream

from kvscope import part_dir

EOS_TEXT = "<|endoftext|>"
# Package data (backend/data/README.md), so that a wheel or a bare clone carries it.
CORPUS_NAME = "tinyshakespeare.txt"


class Tokenizer:
    """encode/decode plus the ids the engine needs (EOS, per-token text) and the model's chat template."""

    def __init__(self, tok: HFTokenizer, eos_token_ids: list[int], chat_template: str | None = None) -> None:
        self._tok = tok
        self.eos_token_ids = eos_token_ids
        self.vocab_size = tok.get_vocab_size()
        self.chat_template = chat_template  # Jinja source, None for the demo models

    @classmethod
    def from_file(cls, path: Path, eos_token_ids: list[int] | None = None,
                  chat_template: str | None = None) -> "Tokenizer":
        tok = HFTokenizer.from_file(str(path))
        if eos_token_ids is None:
            eos = tok.token_to_id(EOS_TEXT)
            eos_token_ids = [] if eos is None else [eos]
        return cls(tok, eos_token_ids, chat_template)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    @cached_property
    def special_texts(self) -> tuple[str, ...]:
        """The texts of the special tokens (control tokens such as <|im_start|>, the end-of-text token)."""
        return tuple(t.content for t in self._tok.get_added_tokens_decoder().values() if t.special)

    @cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    @cached_property
    def _plain(self) -> HFTokenizer:
        """A copy that reads special-token text as plain text. A copy, not a switch: other threads encode
        with the shared tokenizer meanwhile."""
        tok = HFTokenizer.from_str(self._tok.to_str())
        tok.encode_special_tokens = True
        return tok

    def encode_template(self, text: str, restore: Callable[[str], str]) -> list[int]:
        """Ids of a template's output: its special tokens are control tokens; the text between them, passed
        through `restore` (which may bring back special-token text a message spelled), is plain text.

        The tokenizer splits at special tokens before anything else, so where `restore` changes nothing
        this is exactly encode(text)."""
        ids, start = [], 0
        encoding = self._tok.encode(text, add_special_tokens=False)
        for token_id, (begin, end) in zip(encoding.ids, encoding.offsets):
            if token_id in self.special_ids:
                ids += self._plain.encode(restore(text[start:begin]), add_special_tokens=False).ids
                ids.append(token_id)
                start = end
        return ids + self._plain.encode(restore(text[start:]), add_special_tokens=False).ids

    def vocab(self) -> dict[str, int]:
        """Every token's byte-level text (special tokens' too) -> its id."""
        return self._tok.get_vocab(with_added_tokens=True)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def decoder(self) -> Callable[[int], str]:
        """Decode one sequence's tokens as they come: each call returns the text its token completes ("" while
        it is part of an unfinished UTF-8 character). The texts add up to `decode` of the tokens, in time
        linear in their number (tokenizers' DecodeStream keeps a short window of the last tokens)."""
        stream = DecodeStream(skip_special_tokens=False)
        return lambda token_id: stream.step(self._tok, token_id) or ""

    def token_text(self, token_id: int) -> str:
        """The text one token stands for (may be a partial UTF-8 character, shown as U+FFFD)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def save(self, path: Path) -> None:
        self._tok.save(str(path))


def read_chat_template(model_dir: Path) -> str | None:
    """A model folder's Hugging Face chat template: chat_template.jinja, or tokenizer_config.json's (default) one."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    try:
        template = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError):  # absent, not JSON, or not an object: no template
        return None
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    return template if isinstance(template, str) else None


def read_corpus(path: Path | None = None) -> tuple[str, str]:
    """The corpus (default: the bundled Tiny Shakespeare) split by position: first 90% train, last 10% validation."""
    source = path or part_dir("backend") / "data" / CORPUS_NAME
    text = source.read_text(encoding="utf-8")
    cut = int(len(text) * 0.9)
    return text[:cut], text[cut:]


def speeches(text: str) -> list[str]:
    """Blank-line separated speeches, each ending in its own newline."""
    return [s.strip("\n") + "\n" for s in text.split("\n\n") if s.strip()]


def train_bpe(train_text: str, vocab_size: int = 2048) -> Tokenizer:
    """Train byte-level BPE on the training split with <|endoftext|> as token 0."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(speeches(train_text), trainer=trainer)
    return Tokenizer(tok, [tok.token_to_id(EOS_TEXT)])


def encode_corpus(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of a split: speeches joined by the end-of-text token."""
    eos = tokenizer.eos_token_id
    assert eos is not None
    ids: list[int] = []
    for speech in speeches(text):
        ids.extend(tokenizer.encode(speech))
        ids.append(eos)
    return ids
