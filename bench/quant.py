"""Quantization benchmark: what int8/int4 weights and a 16-bit or int8 KV cache cost in quality, and save in bytes.

    python -m bench.quant [--windows N] [--chunk C] [--json OUT.json] [--model demo|smollm2|FILE.gguf]
                          [--only none,gguf-native]

Every setting is scored on the same validation windows (backend/model/quality.py: non-overlapping
256-token windows of the held-out 10% of the corpus) against the unquantized model:
- perplexity exp(mean NLL) and its change ΔPPL in % of the reference's;
- mean KL(reference ‖ quantized) per token, over the full next-token distribution: unlike PPL it
  also sees changes in the probabilities of tokens that did not occur.

Weight-only rows run the quantized copy (backend/model/quant.py) densely over each window. KV rows go
through the real engine: each window is one request, prefilled in `--chunk`-token chunks through
Engine -> ModelRunner -> the paged (torch) attention backend, so every query attends to keys and
values that were rounded into the float16 or int8 cache and read back on the way out; the hidden states of
every position are taken from the model's forward and projected to logits. A "float KV via the
engine" row checks that this path itself adds nothing. For a GGUF file the reference is the file
de-quantized to float32 (`weights="float32"`), and a "gguf-native" row scores the file run as it
stores it (backend/model/gguf_weights.py: its Q4 blocks as int4 layers, other types as int8 rows,
bfloat16 activations in the kernels): the error the native path adds to the file's own.

Targets: int8 weights ΔPPL <= 1% (every group size); int4 group 64 ΔPPL <= 5%; int8 KV ΔPPL <= 1%;
per-tensor int4 measurably worse than every group-wise int4 (higher PPL and KL).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.engine import Engine
from kvscope.backend.engine.kv_cache import DTYPE_NAMES
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.events.bus import EventBus
from kvscope.backend.model.loader import LoadedModel, ModelLoadError, gguf_file, load_model
from kvscope.backend.model.quality import batched_logits, validation_windows
from kvscope.backend.model.quant import quantize_model, weight_bytes
from bench.report import command_line, progress, table

TARGET_INT8_PCT = 1.0
TARGET_INT4_G64_PCT = 5.0
TARGET_KV_INT8_PCT = 1.0
BATCH = 8  # windows per dense forward
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Setting:
    name: str
    weights: str  # none | int8 | int4 | native (a GGUF file as stored)
    group_size: int  # 0 = per tensor
    kv: str  # auto | float16 | int8
    engine: bool  # through the engine's paged cache, or dense

    @property
    def label(self) -> str:
        group = f"g{self.group_size}" if self.group_size else "per-tensor"
        w = {"none": "float", "native": "the GGUF file's own"}.get(self.weights, f"{self.weights} {group}")
        return f"weights {w}, KV {'float' if self.kv == 'auto' else self.kv}" + (" (engine)" if self.engine else "")


SETTINGS = [
    Setting("none", "none", 0, "auto", False),
    *(Setting(f"{mode}-{'pt' if g == 0 else f'g{g}'}", mode, g, "auto", False)
      for mode in ("int8", "int4") for g in (0, 32, 64, 128)),
    Setting("gguf-native", "native", 0, "auto", False),
    Setting("engine-float-kv", "none", 0, "auto", True),
    Setting("kv-float16", "none", 0, "float16", True),
    Setting("kv-int8", "none", 0, "int8", True),
    Setting("int8-g64+kv-int8", "int8", 64, "int8", True),
]


@dataclass
class Score:
    """Running sums over the windows of one setting."""

    nll: float = 0.0
    kl: float = 0.0
    tokens: int = 0

    def add(self, logits: torch.Tensor, ref_logp: torch.Tensor, targets: torch.Tensor) -> None:
        """logits, ref_logp [T, V] (fp32); targets [T]."""
        logp = logits.float().log_softmax(-1)
        self.nll += F.nll_loss(logp, targets, reduction="sum").item()
        self.kl += (ref_logp.exp() * (ref_logp - logp)).sum().item()
        self.tokens += len(targets)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.tokens)

    @property
    def mean_kl(self) -> float:
        return self.kl / self.tokens


# ---- the two ways of scoring a window ---------------------------------------------------------------


def engine_config(setting: Setting, chunk: int, context: int) -> EngineConfig:
    return EngineConfig(block_size=BLOCK_SIZE, num_blocks=math.ceil((context + 1) / BLOCK_SIZE) + 1,
                        max_num_seqs=1, max_num_batched_tokens=chunk, chunked_prefill=True, prefix_caching=False,
                        attention_backend="torch", max_model_len=context + 1, events="off", device="cpu",
                        weight_quant=setting.weights, quant_group_size=setting.group_size,
                        kv_cache_dtype=setting.kv)


class EngineScorer:
    """Logits of every position of a window, computed by the engine as chunked prefill over its cache."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.engine = Engine(loaded, config, EventBus(level="off"))
        self.model = self.engine.executor.runner.model
        self.hidden: list[torch.Tensor] = []
        self.active = False  # the float model is shared with the dense rows: record only our own forwards
        self.model.register_forward_hook(lambda _m, _args, out: self.hidden.append(out) if self.active else None)
        self.count = 0

    def logits(self, window: torch.Tensor) -> torch.Tensor:
        """window [T] token ids -> logits [T, V] at every position."""
        self.hidden.clear()
        self.count += 1
        greedy = SamplingParams(temperature=0.0, ignore_eos=True)
        self.engine.add_request(f"w{self.count}", window.tolist(), 1, greedy)
        self.active = True
        try:
            while self.engine.has_unfinished():
                self.engine.step()
        finally:
            self.active = False
        hidden = torch.cat(self.hidden)  # [T, hidden]: the chunks, in order
        assert hidden.shape[0] == len(window), f"the engine computed {hidden.shape[0]} positions, not {len(window)}"
        with torch.no_grad():
            return self.model.logits(hidden)


def settings_for(loaded: LoadedModel) -> list[Setting]:
    """Every setting the model's shapes allow (SmolLM2's 576 refuses g128); the native row only for a GGUF
    file (another model has nothing stored otherwise)."""
    inputs = {m.in_features for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)}
    return [s for s in SETTINGS if (s.weights != "native" or gguf_file(loaded.name) is not None)
            and not any(s.group_size and k % s.group_size for k in inputs)]


def dense_model(loaded: LoadedModel, setting: Setting) -> torch.nn.Module:
    if setting.weights == "native":
        return load_model(loaded.name).model
    return quantize_model(loaded.model, setting.weights, setting.group_size) if setting.weights != "none" \
        else loaded.model


def score_all(loaded: LoadedModel, rows: torch.Tensor, chunk: int,
              only: set[str] | None = None) -> tuple[dict[str, Score], dict[str, dict]]:
    """Score every setting (or those named in `only`, the reference always) on the windows rows
    [N, context + 1]; also their byte counts."""
    context = rows.shape[1] - 1
    settings = [s for s in settings_for(loaded) if only is None or s.name in only | {"none"}]
    dense = {s.name: dense_model(loaded, s) for s in settings if not s.engine}
    scorers = {s.name: EngineScorer(loaded, engine_config(s, chunk, context)) for s in settings if s.engine}
    scores = {s.name: Score() for s in settings}
    for i in range(0, len(rows), BATCH):
        x, y = rows[i : i + BATCH, :-1], rows[i : i + BATCH, 1:]
        ref_logp = batched_logits(loaded.model, x).log_softmax(-1)  # [B, T, V]
        for name, model in dense.items():
            logits = batched_logits(model, x)
            for b in range(len(x)):
                scores[name].add(logits[b], ref_logp[b], y[b])
        for name, scorer in scorers.items():
            for b in range(len(x)):
                scores[name].add(scorer.logits(x[b]), ref_logp[b], y[b])
        progress(f"{min(i + BATCH, len(rows))}/{len(rows)} windows")
    dtype = DTYPE_NAMES[next(loaded.model.parameters()).dtype]
    float_kv = loaded.config.kv_bytes_per_token(dtype)
    sizes = {name: {"weight_bytes": weight_bytes(model), "kv_bytes_per_token": float_kv}
             for name, model in dense.items()}
    sizes |= {name: {"weight_bytes": weight_bytes(s.model), "kv_bytes_per_token": s.engine.cache.bytes_per_token}
              for name, s in scorers.items()}
    return scores, sizes


# ---- report ---------------------------------------------------------------------------------------


def results(scores: dict[str, Score], sizes: dict[str, dict]) -> list[dict]:
    ref = scores["none"]
    out = []
    for s in (s for s in SETTINGS if s.name in scores):
        sc = scores[s.name]
        out.append(asdict(s) | sizes[s.name] | {
            "label": s.label, "ppl": sc.ppl, "delta_ppl_pct": 100 * (sc.ppl / ref.ppl - 1), "kl": sc.mean_kl,
            "tokens": sc.tokens})
    return out


def targets(rows: list[dict]) -> list[dict]:
    by = {r["name"]: r for r in rows}
    int8 = [r for r in rows if r["weights"] == "int8" and r["kv"] == "auto"]
    worst8 = max(int8, key=lambda r: r["delta_ppl_pct"])
    groups4 = [by[f"int4-g{g}"] for g in (32, 64, 128) if f"int4-g{g}" in by]
    pt4 = by["int4-pt"]
    worse = all(pt4["ppl"] > r["ppl"] and pt4["kl"] > r["kl"] for r in groups4)
    g64, kv = by["int4-g64"]["delta_ppl_pct"], by["kv-int8"]["delta_ppl_pct"]
    return [
        {"name": "int8 weights ΔPPL (worst group size)", "target": f"<= {TARGET_INT8_PCT:g}%",
         "value": f"{worst8['delta_ppl_pct']:+.2f}% ({worst8['name']})",
         "met": worst8["delta_ppl_pct"] <= TARGET_INT8_PCT},
        {"name": "int4 group 64 ΔPPL", "target": f"<= {TARGET_INT4_G64_PCT:g}%", "value": f"{g64:+.2f}%",
         "met": g64 <= TARGET_INT4_G64_PCT},
        {"name": "int8 KV ΔPPL", "target": f"<= {TARGET_KV_INT8_PCT:g}%", "value": f"{kv:+.2f}%",
         "met": kv <= TARGET_KV_INT8_PCT},
        {"name": "per-tensor int4 worse than group-wise int4", "target": "higher PPL and KL than every group size",
         "value": f"PPL {pt4['ppl']:.3f} vs <= {max(r['ppl'] for r in groups4):.3f}, "
                  f"KL {pt4['kl']:.4f} vs <= {max(r['kl'] for r in groups4):.4f}", "met": worse},
    ]


def print_report(meta: dict, rows: list[dict], verdicts: list[dict]) -> None:
    print("## Quantization benchmark\n")
    print(f"- command: `{meta['command']}`")
    print(f"- date: {meta['date']}; torch {meta['torch']}, {meta['torch_threads']} threads, {meta['machine']}")
    print(f"- model: {meta['model']} ({meta['dtype']}); {meta['windows']} validation windows of {meta['context']} "
          f"tokens ({meta['tokens']} predicted tokens); engine rows prefill in chunks of {meta['chunk']}\n")
    base = rows[0]["weight_bytes"]
    print(table(["setting", "weight bytes", "vs none", "KV bytes/token", "PPL", "ΔPPL", "KL(ref ‖ q) /token"],
                [[r["label"], f"{r['weight_bytes']:,}", f"{r['weight_bytes'] / base:.2f}x",
                  f"{r['kv_bytes_per_token']:,}", f"{r['ppl']:.3f}", f"{r['delta_ppl_pct']:+.2f}%", f"{r['kl']:.2e}"]
                 for r in rows]))
    print()
    for v in verdicts:
        print(f"{'PASS' if v['met'] else 'FAIL'}: {v['name']} (target {v['target']}): {v['value']}")
    print()


# ---- main -----------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.quant", description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, default=64, help="validation windows to score (default 64; 0 = all)")
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk size of the engine rows (default 64)")
    p.add_argument("--json", type=Path, metavar="OUT.json", help="write every number to this file")
    p.add_argument("--model", default="demo", help="shipped model name, model folder or .gguf file (default: demo)")
    p.add_argument("--only", help="score only these settings (comma-separated names, e.g. gguf-native); "
                                  "the float reference always, the targets never")
    args = p.parse_args(argv)
    if args.windows < 0 or args.chunk < 1:
        p.error("--windows must be >= 0 and --chunk >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        loaded = load_model(args.model, weights="float32")  # a GGUF file's reference: its floats
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = validation_windows(loaded.tokenizer)
    rows = rows[: args.windows] if args.windows else rows
    started = time.perf_counter()
    scores, sizes = score_all(loaded, rows, args.chunk, set(args.only.split(",")) if args.only else None)
    table_rows = results(scores, sizes)
    verdicts = [] if args.only else targets(table_rows)  # the targets compare settings a partial run lacks
    meta = {"command": command_line("bench.quant", argv),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "model": args.model,
            "dtype": DTYPE_NAMES[next(loaded.model.parameters()).dtype], "windows": len(rows),
            "context": rows.shape[1] - 1, "tokens": scores["none"].tokens, "chunk": args.chunk,
            "seconds": time.perf_counter() - started}
    print_report(meta, table_rows, verdicts)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": table_rows, "targets": verdicts}, indent=2) + "\n")
        progress(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
