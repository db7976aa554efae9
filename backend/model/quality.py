"""Model quality on the validation split: loss, bits per character, draft acceptance rate."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvscope.backend.model.attention import DenseCausalBackend
from kvscope.backend.model.tokenizer import Tokenizer, encode_corpus, read_corpus
from kvscope.backend.model.transformer import CausalLM

CONTEXT = 256


def windows(data: torch.Tensor, context: int = CONTEXT) -> torch.Tensor:
    """Non-overlapping windows of context + 1 tokens covering the split: [n, context + 1]."""
    n = (len(data) - 1) // context
    return torch.stack([data[i * context : i * context + context + 1] for i in range(n)])


def validation_windows(tokenizer: Tokenizer) -> torch.Tensor:
    _, val_text = read_corpus()
    return windows(torch.tensor(encode_corpus(tokenizer, val_text)))


@torch.no_grad()
def batched_logits(model: CausalLM, x: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] for token rows x [B, T] (fp32)."""
    positions = torch.arange(x.shape[1]).expand_as(x)
    return model.logits(model(x, positions, DenseCausalBackend()))


@torch.no_grad()
def evaluate(model: CausalLM, rows: torch.Tensor, batch: int = 16) -> float:
    """Mean negative log-likelihood in nats per token over the given windows."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(rows), batch):
        x, y = rows[i : i + batch, :-1], rows[i : i + batch, 1:]
        total += F.cross_entropy(batched_logits(model, x).flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    model.train(was_training)
    return total / count


def chars_covered(rows: torch.Tensor, tokenizer: Tokenizer) -> int:
    """Characters the target tokens of the windows stand for (EOS counts as the newline it replaces)."""
    targets = rows[:, 1:].flatten().tolist()
    eos = tokenizer.eos_token_id
    return len(tokenizer.decode([t for t in targets if t != eos])) + targets.count(eos)


def bits_per_char(nats_per_token: float, rows: torch.Tensor, tokenizer: Tokenizer) -> float:
    return nats_per_token / math.log(2) * rows[:, 1:].numel() / chars_covered(rows, tokenizer)


@torch.no_grad()
def acceptance_rate(target: CausalLM, draft: CausalLM, rows: torch.Tensor, batch: int = 16) -> float:
    """Expected speculative acceptance at T=1: alpha = E[sum_x min(p(x), q(x))] over positions."""
    total, count = 0.0, 0
    for i in range(0, len(rows), batch):
        x = rows[i : i + batch, :-1]
        p = batched_logits(target, x).softmax(-1)
        q = batched_logits(draft, x).softmax(-1)
        total += torch.minimum(p, q).sum(-1).sum().item()
        count += x.numel()
    return total / count
