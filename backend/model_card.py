"""The short README.md written beside each trained model: data, size, steps, time, loss, a sample."""

from __future__ import annotations

import json
from pathlib import Path

from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.model.loader import SHIPPED_MODELS_DIR, load_model
from kvscope.backend.model.quality import acceptance_rate, validation_windows
from kvscope.backend.engine.reference import reference_generate

SAMPLE_PROMPT = "ROMEO:\n"


def draft_target(folder: Path) -> Path | None:
    """The demo trained beside a draft, else the shipped one: the target its alpha is measured against."""
    for candidate in (folder.parent / "demo", SHIPPED_MODELS_DIR / "demo"):
        if (candidate / "model.safetensors").is_file():
            return candidate
    return None


def write_model_card(folder: Path) -> None:
    """(Re)write FOLDER/README.md from its metrics.json; a draft also gets alpha against its target."""
    metrics = json.loads((folder / "metrics.json").read_text())
    loaded = load_model(folder)
    target = draft_target(folder) if folder.name == "demo-draft" else None
    if target:
        rows = validation_windows(loaded.tokenizer)
        metrics["alpha_vs_demo_T1"] = round(acceptance_rate(load_model(target).model, loaded.model, rows), 4)
        (folder / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    tok = loaded.tokenizer
    prompt = tok.encode(SAMPLE_PROMPT)
    params = SamplingParams(temperature=0.8, seed=0)
    sample = tok.decode([t for t in reference_generate(loaded.model, prompt, 120, params, tok.eos_token_ids)
                         if t not in tok.eos_token_ids])
    c = loaded.config
    shape = f"{c.num_hidden_layers} layers x {c.hidden_size} wide, {c.num_attention_heads} query / " \
            f"{c.num_key_value_heads} KV heads ({c.attention.upper()}), head_dim {c.head_dim}, ffn {c.intermediate_size}"
    if c.mla:
        shape += f"; MLA kv_lora_rank {c.mla.kv_lora_rank}, rope key {c.mla.qk_rope_head_dim}"
    lines = [
        f"# {folder.name}",
        "",
        f"Trained by `kvscope train --model {folder.name}` on Tiny Shakespeare (`backend/data/tinyshakespeare.txt`, "
        "first 90% train, last 10% validation), byte-level BPE with 2,048 tokens and an end-of-text token "
        "between speeches.",
        "",
        "| | |",
        "| --- | --- |",
        f"| architecture | `{c.architecture}` |",
        f"| shape | {shape} |",
        f"| parameters | {metrics['parameters']:,} |",
        f"| KV cache | {c.kv_bytes_per_token('float16'):,} bytes per token in fp16 |",
        f"| training | {metrics['steps']} steps of {metrics['batch']}, AdamW 1e-3, cosine, seed {metrics['seed']} |",
        f"| time | {metrics['train_seconds']} s on {metrics['threads']} CPU threads |",
        f"| validation | {metrics['val_nats_per_token']} nats/token, {metrics['val_bits_per_char']} bits/char |",
    ]
    if "alpha_vs_demo_T1" in metrics:
        lines.append(f"| acceptance vs demo | alpha = {metrics['alpha_vs_demo_T1']} at T=1 (E[sum min(p, q)]) |")
    lines += ["", f"Sample (prompt `{SAMPLE_PROMPT!r}`, temperature 0.8, seed 0):", "", "```",
              SAMPLE_PROMPT + sample, "```", ""]
    (folder / "README.md").write_text("\n".join(lines))
