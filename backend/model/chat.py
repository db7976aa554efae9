"""Chat messages -> one prompt string, for `/v1/chat/completions` and a scenario's `messages` requests.

A model whose tokenizer carries a Hugging Face chat template (`chat_template` in tokenizer_config.json,
chat_template.jinja, or a GGUF file's `tokenizer.chat_template`) is rendered with it. The demo models
have none: they were trained on Tiny Shakespeare speeches, "NAME:\\ntext\\n", each followed by the
end-of-text token. So the default template writes every message as such a speech, by a speaker chosen
for its role, and ends with the assistant's name and a newline: the model then writes the assistant's
speech and stops on its own.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvscope.backend.errors import KvscopeError

if TYPE_CHECKING:
    from kvscope.backend.model.loader import LoadedModel

# Speakers the demo models met often in training (ROMEO and JULIET have ~150 speeches each), so
# they answer in character; a message's own `name` takes precedence.
SPEAKERS = {"system": "CHORUS", "developer": "CHORUS", "user": "ROMEO", "assistant": "JULIET", "tool": "MESSENGER"}
ASSISTANT_SPEAKER = SPEAKERS["assistant"]


class ChatTemplateError(KvscopeError):
    """Messages the model's chat template refuses (it may raise on purpose, e.g. roles out of order)."""


def render_chat(messages: list[dict[str, Any]], loaded: LoadedModel) -> str:
    """The prompt for these messages, ready for the model to write the assistant's turn."""
    tokenizer = loaded.tokenizer
    if tokenizer.chat_template is None:
        eos_text = tokenizer.token_text(tokenizer.eos_token_id) if tokenizer.eos_token_ids else ""
        return render_speeches(messages, eos_text)
    return render_template(tokenizer.chat_template, messages, special_tokens(loaded.path))


def render_speeches(messages: list[dict[str, Any]], eos_text: str) -> str:
    """The default template: each message as a speech "SPEAKER:\\ncontent\\n<eos>", then "JULIET:\\n"."""
    parts = []
    for m in messages:
        speaker = (m.get("name") or SPEAKERS.get(m["role"], m["role"])).upper()
        parts.append(f"{speaker}:\n{m['content'].strip()}\n{eos_text}")
    return "".join(parts) + f"{ASSISTANT_SPEAKER}:\n"


def render_template(template: str, messages: list[dict[str, Any]], tokens: dict[str, str]) -> str:
    """A Hugging Face chat template rendered as transformers' apply_chat_template does (generation prompt on)."""
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=True, tools=None, **tokens)
    except jinja2.TemplateError as e:
        raise ChatTemplateError("messages", f"the model's chat template refused them ({e})") from None


def special_tokens(model_dir: Path) -> dict[str, str]:
    """bos_token and eos_token as a template sees them, from the folder's tokenizer_config.json."""
    config = _tokenizer_config(model_dir)
    return {"bos_token": _token_text(config.get("bos_token")), "eos_token": _token_text(config.get("eos_token"))}


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    # Sandboxed: a chat template is code that came with a downloaded model.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    return env.from_string(template)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tokenizer_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return config if isinstance(config, dict) else {}


def _token_text(token: Any) -> str:
    """Special tokens in tokenizer_config.json are strings or {"content": ...} objects."""
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token if isinstance(token, str) else ""
