"""Training the demo models on Tiny Shakespeare (`kvscope train`).

Seeded and resumable. Everything goes under an output root (default: the user's cache folder; the
shipped backend/models only when named explicitly): OUT/NAME/train_state.pt, the checkpoint, is
written at least every minute, at the end, and when SIGINT or SIGTERM stops the run, and a resumed
run continues from it exactly. fp32 with small batches, as measured fastest on a 2-core CPU
(PITFALLS). The best validation checkpoint is kept (early stopping: the corpus is small).
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from kvscope.backend.config import KVSCOPE_ARCHITECTURE, MLAConfig, ModelConfig
from kvscope.backend.errors import KvscopeError
from kvscope.backend.model.attention import DenseCausalBackend
from kvscope.backend.model.loader import SHIPPED_MODELS_DIR, save_model
from kvscope.backend.model.quality import CONTEXT, bits_per_char, evaluate, validation_windows
from kvscope.backend.model.tokenizer import Tokenizer, encode_corpus, read_corpus, train_bpe
from kvscope.backend.model.transformer import CausalLM, num_parameters

VOCAB_SIZE = 2048
TOKENIZER_PATH = SHIPPED_MODELS_DIR / "tokenizer.json"
CHECKPOINT = "train_state.pt"
CHECKPOINT_EVERY_S = 60.0  # the most work a crash or a kill -9 can lose


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
    seed: int = 0


class TrainError(KvscopeError):
    """An output folder that does not fit the request: the message names the option and the reason."""


class TrainingStopped(Exception):
    """SIGINT or SIGTERM stopped training; the checkpoint of `step` is saved."""

    def __init__(self, name: str, step: int, signum: int) -> None:
        super().__init__(f"{name} stopped at step {step} by signal {signum}")
        self.name, self.step, self.signum = name, step, signum


def default_out_root() -> Path:
    """$XDG_CACHE_HOME/kvscope/models, else ~/.cache/kvscope/models: never the shipped weights."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "kvscope" / "models"


def checkpoint_path(out_root: Path, name: str) -> Path:
    return out_root / name / CHECKPOINT


def check_out_root(out_root: Path, names: list[str], resume: bool) -> None:
    """Refuse to start over a checkpoint (its progress would be lost) or to resume from none at all."""
    found = [n for n in names if checkpoint_path(out_root, n).is_file()]
    if resume and not found:
        raise TrainError("--resume", f"no {CHECKPOINT} of {', '.join(names)} under {out_root}")
    if found and not resume:
        raise TrainError(f"--out {out_root}", f"{found[0]} has a checkpoint there; add --resume to continue it, "
                                              "or choose another --out")


def load_tokenizer(out_root: Path) -> Tokenizer:
    """The shipped tokenizer, which every demo model shares; without it, one trained once into out_root."""
    for path in (TOKENIZER_PATH, out_root / "tokenizer.json"):
        if path.is_file():
            return Tokenizer.from_file(path)
    tok = train_bpe(read_corpus()[0], VOCAB_SIZE)
    out_root.mkdir(parents=True, exist_ok=True)
    tok.save(out_root / "tokenizer.json")
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


@dataclass
class _Trainer:
    """What a checkpoint holds: the model, its optimizer, the batch sampler and the progress."""

    model: CausalLM
    opt: torch.optim.Optimizer
    gen: torch.Generator
    state: dict
    path: Path

    @classmethod
    def start(cls, config: ModelConfig, s: TrainSettings, path: Path, resume: bool) -> _Trainer:
        """A seeded fresh start, or (resume) the checkpoint at path where there is one."""
        torch.manual_seed(s.seed)
        model = CausalLM(config)
        opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=s.weight_decay)
        trainer = cls(model, opt, torch.Generator().manual_seed(s.seed),
                      {"step": 0, "best_val": float("inf"), "best": None, "elapsed_s": 0.0}, path)
        if resume and path.is_file():
            trainer.load()
        if trainer.state["step"] > s.steps:
            raise TrainError(f"--steps {s.steps}", f"the checkpoint in {path.parent} is already at step "
                                                   f"{trainer.state['step']}")
        return trainer

    def load(self) -> None:
        ckpt = torch.load(self.path, weights_only=False)
        self.model.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["opt"])
        self.gen.set_state(ckpt["gen"])
        self.state = ckpt["state"]

    def save(self, elapsed_s: float) -> None:
        """Written beside and renamed into place, so a kill mid-write leaves the previous checkpoint whole."""
        self.state["elapsed_s"] = elapsed_s
        partial = self.path.with_suffix(".partial")
        torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict(), "gen": self.gen.get_state(),
                    "state": self.state}, partial)
        os.replace(partial, self.path)

    def step(self, s: TrainSettings, data: torch.Tensor) -> float:
        """One optimizer step on a random batch; returns its loss."""
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.state["step"], s)
        x, y = random_batch(data, s.batch_size, self.gen)
        positions = torch.arange(CONTEXT).expand(s.batch_size, CONTEXT)
        logits = self.model.logits(self.model(x, positions, DenseCausalBackend()))
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.state["step"] += 1
        return loss.item()

    def keep_if_best(self, val: float) -> None:
        if val < self.state["best_val"]:
            self.state["best_val"] = val
            self.state["best"] = {k: v.clone() for k, v in self.model.state_dict().items()}


def train_model(name: str, out_root: Path | None = None, steps: int | None = None, threads: int | None = None,
                resume: bool = False) -> dict:
    """Train one preset into OUT/NAME (from its checkpoint if resume); returns the metrics written beside the weights.

    SIGINT or SIGTERM saves the checkpoint and raises TrainingStopped.
    """
    if threads:
        torch.set_num_threads(threads)
    out_root = out_root or default_out_root()
    out_dir = out_root / name
    s = TrainSettings(steps=steps or STEPS[name])
    with _signals_noted() as received:
        tokenizer = load_tokenizer(out_root)
        train_ids = torch.tensor(encode_corpus(tokenizer, read_corpus()[0]))
        val_rows = validation_windows(tokenizer)
        out_dir.mkdir(parents=True, exist_ok=True)
        trainer = _Trainer.start(PRESETS[name], s, checkpoint_path(out_root, name), resume)
        print(f"training {name} from step {trainer.state['step']} of {s.steps} into {out_dir}", flush=True)
        _train_loop(name, trainer, s, train_ids, val_rows, received)
    return _finish(name, trainer, s, tokenizer, val_rows, out_dir)


def _train_loop(name: str, t: _Trainer, s: TrainSettings, train_ids: torch.Tensor, val_rows: torch.Tensor,
                received: list[int]) -> None:
    """Steps up to s.steps; checkpoints every CHECKPOINT_EVERY_S, at the end, and when a signal arrives."""
    quick_val = val_rows[:: max(1, len(val_rows) // 32)]  # a fixed subset for early stopping
    started = time.perf_counter() - t.state["elapsed_s"]
    last_save = time.perf_counter()
    t.model.train()
    with _progress() as bar:
        task = bar.add_task(f"train {name}", total=s.steps, completed=t.state["step"], loss=float("nan"))
        while t.state["step"] < s.steps:
            bar.update(task, advance=1, loss=t.step(s, train_ids))
            done = t.state["step"] == s.steps
            if t.state["step"] % s.eval_every == 0 or done:
                t.keep_if_best(evaluate(t.model, quick_val))
            now = time.perf_counter()
            if received or done or now - last_save >= CHECKPOINT_EVERY_S:
                t.save(elapsed_s=now - started)
                last_save = now
            if received:
                raise TrainingStopped(name, t.state["step"], received[0])


def _finish(name: str, t: _Trainer, s: TrainSettings, tokenizer: Tokenizer, val_rows: torch.Tensor,
            out_dir: Path) -> dict:
    """The best checkpoint's weights, and its metrics on the whole validation split, written to out_dir."""
    model = t.model
    model.load_state_dict(t.state["best"])
    model.eval()
    val_nats = evaluate(model, val_rows)
    metrics = {
        "name": name,
        "parameters": num_parameters(model.config),
        "steps": s.steps,
        "batch": f"{s.batch_size} x {CONTEXT} tokens",
        "train_seconds": round(t.state["elapsed_s"], 1),
        "threads": torch.get_num_threads(),
        "val_nats_per_token": round(val_nats, 4),
        "val_bits_per_char": round(bits_per_char(val_nats, val_rows, tokenizer), 4),
        "seed": s.seed,
    }
    save_model(model, tokenizer, out_dir)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


@contextmanager
def _signals_noted() -> Iterator[list[int]]:
    """SIGINT and SIGTERM are noted, for the loop to act on after the current step instead of dying mid-write."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received  # only the main thread may set handlers; elsewhere signals keep their defaults
        return
    previous = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), TimeRemainingColumn())
