"""Training the demo models on Tiny Shakespeare (`kvscope train`).

Seeded and resumable: a checkpoint (`train_state.pt`, not shipped) is written every few steps and
picked up on the next run. fp32 with small batches, as measured fastest on a 2-core CPU
(shared/PITFALLS.md). The best validation checkpoint is kept (early stopping: the corpus is small).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from backend.config import KVSCOPE_ARCHITECTURE, MLAConfig, ModelConfig
from backend.model.attention import DenseCausalBackend
from backend.model.loader import SHIPPED_MODELS_DIR, save_model
from backend.model.quality import CONTEXT, bits_per_char, evaluate, validation_windows
from backend.model.tokenizer import Tokenizer, encode_corpus, read_corpus, train_bpe
from backend.model.transformer import CausalLM, num_parameters

VOCAB_SIZE = 2048
TOKENIZER_PATH = SHIPPED_MODELS_DIR / "tokenizer.json"


def _config(layers: int, width: int, heads: int, kv_heads: int, ffn: int, **extra) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=VOCAB_SIZE,
        hidden_size=width,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=width // heads,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        **extra,
    )


# demo and its attention variants share size, data, steps and seed, so that KV memory and quality
# compare honestly; only the attention differs.
PRESETS: dict[str, ModelConfig] = {
    "demo": _config(6, 256, 8, 2, 768),
    "demo-mha": _config(6, 256, 8, 8, 768),
    "demo-mqa": _config(6, 256, 8, 1, 768),
    "demo-mla": _config(6, 256, 8, 8, 768, mla=MLAConfig(kv_lora_rank=64, qk_nope_head_dim=32,
                                                          qk_rope_head_dim=16, v_head_dim=32)).model_copy(
        update={"architecture": KVSCOPE_ARCHITECTURE}),
    "demo-draft": _config(2, 128, 4, 1, 384),
}
STEPS = {"demo": 1100, "demo-mha": 1100, "demo-mqa": 1100, "demo-mla": 1100, "demo-draft": 1600}


@dataclass
class TrainSettings:
    steps: int
    batch_size: int = 8
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.1
    eval_every: int = 50
    checkpoint_every: int = 50
    seed: int = 0


def load_or_train_tokenizer(path: Path = TOKENIZER_PATH) -> Tokenizer:
    if path.is_file():
        return Tokenizer.from_file(path)
    train_text, _ = read_corpus()
    tok = train_bpe(train_text, VOCAB_SIZE)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(path)
    return tok


def lr_at(step: int, s: TrainSettings) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio of the peak."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def random_batch(data: torch.Tensor, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(data) - CONTEXT - 1, (batch,), generator=gen)
    rows = torch.stack([data[s : s + CONTEXT + 1] for s in starts.tolist()])  # [batch, CONTEXT + 1]
    return rows[:, :-1], rows[:, 1:]


def train_model(name: str, out_root: Path = SHIPPED_MODELS_DIR, steps: int | None = None,
                threads: int | None = None) -> dict:
    """Train one preset, resuming from its checkpoint; returns the metrics written beside the weights."""
    if threads:
        torch.set_num_threads(threads)
    config = PRESETS[name]
    s = TrainSettings(steps=steps or STEPS[name])
    tokenizer = load_or_train_tokenizer()
    train_text, _ = read_corpus()
    train_ids = torch.tensor(encode_corpus(tokenizer, train_text))
    val_rows = validation_windows(tokenizer)
    quick_val = val_rows[:: max(1, len(val_rows) // 32)]  # a fixed subset for early stopping

    torch.manual_seed(s.seed)
    model = CausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=s.weight_decay)
    gen = torch.Generator().manual_seed(s.seed)
    out_dir = out_root / name
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = out_dir / "train_state.pt"
    state = {"step": 0, "best_val": float("inf"), "best": None, "elapsed_s": 0.0}
    if ckpt_path.is_file():
        ckpt = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        gen.set_state(ckpt["gen"])
        state = ckpt["state"]

    attn = DenseCausalBackend()
    positions = torch.arange(CONTEXT).expand(s.batch_size, CONTEXT)
    model.train()
    started = time.perf_counter() - state["elapsed_s"]
    with _progress() as bar:
        task = bar.add_task(f"train {name}", total=s.steps, completed=state["step"], loss=float("nan"))
        for step in range(state["step"], s.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, s)
            x, y = random_batch(train_ids, s.batch_size, gen)
            loss = F.cross_entropy(model.logits(model(x, positions, attn)).flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            state["step"] = step + 1
            bar.update(task, advance=1, loss=loss.item())
            if state["step"] % s.eval_every == 0 or state["step"] == s.steps:
                val = evaluate(model, quick_val)
                if val < state["best_val"]:
                    state["best_val"] = val
                    state["best"] = {k: v.clone() for k, v in model.state_dict().items()}
            if state["step"] % s.checkpoint_every == 0 or state["step"] == s.steps:
                state["elapsed_s"] = time.perf_counter() - started
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                            "state": state}, ckpt_path)

    model.load_state_dict(state["best"])
    model.eval()
    val_nats = evaluate(model, val_rows)
    metrics = {
        "name": name,
        "parameters": num_parameters(config),
        "steps": s.steps,
        "batch": f"{s.batch_size} x {CONTEXT} tokens",
        "train_seconds": round(state["elapsed_s"], 1),
        "threads": torch.get_num_threads(),
        "val_nats_per_token": round(val_nats, 4),
        "val_bits_per_char": round(bits_per_char(val_nats, val_rows, tokenizer), 4),
        "seed": s.seed,
    }
    save_model(model, tokenizer, out_dir)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), TimeRemainingColumn())
