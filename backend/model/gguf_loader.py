"""GGUF files (llama.cpp's format) as kvscope model folders: read once, de-quantized, cached.

A .gguf file carries the config, the tokenizer and the (often quantized) weights under llama.cpp's
names. `gguf_model_dir` turns it into an ordinary model folder (config.json, model.safetensors,
tokenizer.json and tokenizer_config.json with the chat template) in the user's cache, keyed by the
file's path, size and mtime and the dtype: the next start reads safetensors and skips the parsing and
the de-quantization. The folder then loads like any other.

Supported: architectures `llama` (Mistral files are `llama` too: llama.cpp writes them so) and `qwen2`;
the tensor types in SUPPORTED_TYPES, de-quantized by the `gguf` package itself; byte-level BPE
tokenizers (`tokenizer.ggml.model == "gpt2"`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from pydantic import ValidationError
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from kvscope.backend.config import ModelConfig
from kvscope.backend.errors import ModelLoadError, validation_error
from kvscope.backend.model.gguf_layout import check_layout
from kvscope.backend.model.transformer import check_weights

CACHE_FORMAT = 1  # part of the cache key: bump when the converted folder's contents change
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# llama.cpp's converter reorders the query and key rows of llama files for its RoPE kernel, which
# rotates adjacent pairs (x0, x1) where Hugging Face's rotates the two halves (x0, x_{d/2}).
PERMUTED_ARCHITECTURES = {"llama"}
Q = GGMLQuantizationType
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types: special tokens, and added tokens kept whole

GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}

# The pre-tokenizer splits of llama.cpp (`tokenizer.ggml.pre`): the merges were learned on these
# pieces, so splitting otherwise gives other tokens. Anything not listed splits like GPT-2.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    "smollm": [r"\p{N}", GPT2_SPLIT], "starcoder": [r"\p{N}", GPT2_SPLIT],
    "llama-bpe": [LLAMA3_SPLIT], "llama3": [LLAMA3_SPLIT], "llama-v3": [LLAMA3_SPLIT],
    "qwen2": [QWEN2_SPLIT], "deepseek-r1-qwen": [QWEN2_SPLIT],
}
_MISSING = object()


@dataclass
class GGUFFile:
    """A parsed GGUF file and its path, for metadata look-ups that fail with one clear line."""

    path: Path
    reader: GGUFReader

    def get(self, key: str, default: Any = _MISSING) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise ModelLoadError(str(self.path), f"missing metadata {key}")
            return default
        try:
            return field.contents()
        except ValueError as e:  # a string that is not UTF-8
            raise ModelLoadError(str(self.path), f"{key}: not readable ({e})") from None

    def strings(self, key: str) -> list[str]:
        """A metadata array of strings (the vocabulary, the merges), or one line saying it is not one."""
        value = self.get(key)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ModelLoadError(str(self.path), f"{key}: not an array of strings")
        return value


def cache_root() -> Path:
    """$XDG_CACHE_HOME/kvscope/gguf, or ~/.cache/kvscope/gguf."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvscope" / "gguf"


def cache_key(path: Path, dtype: torch.dtype | None) -> str:
    """Changes when the file is replaced or touched, or another dtype is asked for."""
    stat = path.stat()
    ident = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}|{CACHE_FORMAT}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def gguf_model_dir(path: Path, dtype: torch.dtype | None = torch.float32) -> Path:
    """The cached model folder for this GGUF file, converting the file first if there is none.
    dtype None: config and tokenizer only, for a file whose weights load natively (gguf_weights.py)."""
    out = cache_root() / f"{path.stem}-{cache_key(path, dtype)}"
    if out.is_dir():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Convert beside the target and rename: a crash or a second process never leaves half a folder.
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=out.parent))
    try:
        convert_gguf(path, tmp, dtype)
        try:
            tmp.rename(out)
        except OSError:
            if not out.is_dir():  # not a lost race with another process: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def convert_gguf(path: Path, out_dir: Path, dtype: torch.dtype | None) -> None:
    """Write the model folder for a GGUF file: config, de-quantized weights (none when dtype is None), tokenizer.

    Everything is checked before anything is sized from it: the header's lengths against the file
    (gguf_layout.py), the metadata as a config (model_config), the tensor infos' names, shapes and
    types against that config, the vocabulary against its size; then the tensors are read."""
    f = open_gguf(path)
    config = hf_config(f, dtype or torch.float32)
    model = model_config(f, config)
    check_tensor_infos(f, model)
    tokenizer, tokenizer_config = build_tokenizer(f, model.vocab_size)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if dtype is not None:
        save_file(read_tensors(f, config, dtype), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def gguf_facts(path: Path) -> tuple[ModelConfig, bool]:
    """The file's config and whether it has a chat template, from its metadata alone (no conversion)."""
    f = open_gguf(path)
    return model_config(f, hf_config(f, torch.float32)), f.get("tokenizer.chat_template", None) is not None


def open_gguf(path: Path) -> GGUFFile:
    check_layout(path)
    try:
        return GGUFFile(path, GGUFReader(path))
    except (ValueError, OSError, IndexError) as e:  # the reader raises ValueError on a bad magic or version
        raise ModelLoadError(str(path), f"not a readable GGUF file ({e})") from None


def hf_config(f: GGUFFile, dtype: torch.dtype) -> dict[str, Any]:
    """The Hugging Face config.json that the file's `{arch}.*` metadata describes."""
    arch = f.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(str(f.path), f"general.architecture: unsupported {arch!r} "
                                          f"(supported: {', '.join(ARCHITECTURES)}; Mistral files are llama)")
    heads = f.get(f"{arch}.attention.head_count")
    tensor_names = {t.name for t in f.reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError(str(f.path), "rope_freqs.weight: per-frequency RoPE factors (Llama 3.1) are not supported")
    name = str(f.get("general.name", ""))
    return {
        "architectures": ["MistralForCausalLM" if arch == "llama" and "mistral" in name.lower() else ARCHITECTURES[arch]],
        "vocab_size": f.get(f"{arch}.vocab_size", None) or len(f.strings("tokenizer.ggml.tokens")),
        "hidden_size": f.get(f"{arch}.embedding_length"),
        "intermediate_size": f.get(f"{arch}.feed_forward_length"),
        "num_hidden_layers": f.get(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": f.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": f.get(f"{arch}.attention.key_length", None),  # None: hidden_size / head_count
        "max_position_embeddings": f.get(f"{arch}.context_length", 2048),
        "rope_theta": f.get(f"{arch}.rope.freq_base", 10000.0),
        "rope_scaling": rope_scaling(f, arch),
        "rms_norm_eps": f.get(f"{arch}.attention.layer_norm_rms_epsilon"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": eos_token_ids(f),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


# The metadata key each config field is read from ({arch}: general.architecture), to name in errors.
METADATA_KEYS = {
    "vocab_size": "{arch}.vocab_size", "hidden_size": "{arch}.embedding_length",
    "intermediate_size": "{arch}.feed_forward_length", "num_hidden_layers": "{arch}.block_count",
    "num_attention_heads": "{arch}.attention.head_count", "num_key_value_heads": "{arch}.attention.head_count_kv",
    "head_dim": "{arch}.attention.key_length", "max_position_embeddings": "{arch}.context_length",
    "rope_theta": "{arch}.rope.freq_base", "rope_scaling": "{arch}.rope.scaling.factor",
    "rms_norm_eps": "{arch}.attention.layer_norm_rms_epsilon", "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
}


def model_config(f: GGUFFile, config: dict[str, Any]) -> ModelConfig:
    """hf_config's dict as a validated ModelConfig (types, ranges, heads that divide); errors name the metadata key."""
    arch = f.get("general.architecture")
    try:
        model = ModelConfig.from_hf_dict(config)
    except ValidationError as e:
        error = validation_error(e)
        # A field's own check names it in `field`; one across fields starts its reason with it ("eos_token_id: ...").
        field, reason = (error.field, error.reason) if error.field else error.reason.partition(": ")[::2]
        key = METADATA_KEYS.get(field.split(".")[0])
        raise ModelLoadError(str(f.path), f"{key.format(arch=arch)}: {reason}" if key else error.reason) from None
    except ValueError as e:  # from_hf_dict's own checks of the dict's shape
        raise ModelLoadError(str(f.path), str(e)) from None
    if f.get(f"{arch}.rope.dimension_count", model.head_dim) != model.head_dim:
        raise ModelLoadError(str(f.path), f"{arch}.rope.dimension_count: partial rotary embeddings are not supported")
    return model


def check_tensor_infos(f: GGUFFile, config: ModelConfig) -> None:
    """The tensors' types, names and shapes (from their infos, before any data is read) against the config."""
    for t in f.reader.tensors:
        if t.tensor_type not in SUPPORTED_TYPES:
            names = ", ".join(q.name for q in SUPPORTED_TYPES)
            raise ModelLoadError(str(f.path), f"tensor {t.name} has type {t.tensor_type.name} (supported: {names})")
    shapes = {hf_tensor_name(f, t.name): tuple(int(n) for n in reversed(t.shape)) for t in f.reader.tensors}
    check_weights(config, shapes, f.path, implied_by="the metadata")


def rope_scaling(f: GGUFFile, arch: str) -> dict[str, Any] | None:
    kind = f.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": f.get(f"{arch}.rope.scaling.factor")}
    raise ModelLoadError(str(f.path), f"{arch}.rope.scaling.type: {kind!r} is not supported (none, linear)")


def eos_token_ids(f: GGUFFile) -> list[int]:
    """End of sequence, and end of turn where the file names a different one."""
    ids = [f.get(f"tokenizer.ggml.{key}", None) for key in ("eos_token_id", "eot_token_id")]
    return list(dict.fromkeys(i for i in ids if i is not None))


def build_tokenizer(f: GGUFFile, vocab_size: int) -> tuple[HFTokenizer, dict[str, Any]]:
    """The byte-level BPE tokenizer the metadata describes, and its tokenizer_config.json."""
    kind = f.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(str(f.path), f"tokenizer.ggml.model: {kind!r} is not supported (only 'gpt2', byte-level BPE)")
    tokens = f.strings("tokenizer.ggml.tokens")
    if len(tokens) > vocab_size:  # ids past the embedding's rows would be sampled and looked up
        raise ModelLoadError(str(f.path), f"tokenizer.ggml.tokens: {len(tokens):,} tokens, more than the "
                                          f"{vocab_size:,} rows of token_embd.weight")
    merges = [tuple(m.split(" ", 1)) for m in f.strings("tokenizer.ggml.merges")]
    try:
        tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    except Exception as e:  # tokenizers raises its own Exception subclass for merges it cannot use
        raise ModelLoadError(str(f.path), f"tokenizer.ggml.merges: {e}") from None
    splits = PRE_TOKENIZER_SPLITS.get(f.get("tokenizer.ggml.pre", "default"), [GPT2_SPLIT])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    types = f.get("tokenizer.ggml.token_type", [])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    return tok, tokenizer_config(f, tokens)


def tokenizer_config(f: GGUFFile, tokens: list[str]) -> dict[str, Any]:
    """What a chat template renders with: the template itself and the BOS / EOS texts."""
    def text(key: str) -> str | None:
        token_id = f.get(f"tokenizer.ggml.{key}", None)
        return tokens[token_id] if token_id is not None and token_id < len(tokens) else None

    return {"chat_template": f.get("tokenizer.chat_template", None), "bos_token": text("bos_token_id"),
            "eos_token": text("eos_token_id"), "add_bos_token": bool(f.get("tokenizer.ggml.add_bos_token", False))}


def read_tensors(f: GGUFFile, config: dict[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor de-quantized to `dtype` under its Hugging Face name, query/key rows in HF order."""
    rope_heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    if f.get("general.architecture") not in PERMUTED_ARCHITECTURES:
        rope_heads = {}
    tensors = {}
    for t in f.reader.tensors:  # check_tensor_infos has held their names, shapes and types to the config
        name = hf_tensor_name(f, t.name)
        w = dequantize_tensor(t)
        kind = t.name.split(".")[-2]  # "blk.3.attn_q.weight" -> "attn_q"
        if kind in rope_heads:
            w = unpermute_rope_rows(w, rope_heads[kind])
        tensors[name] = w.to(dtype).contiguous()
    return tensors


def hf_tensor_name(f: GGUFFile, name: str) -> str:
    """llama.cpp's tensor name -> Hugging Face's ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight")."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[parts[0]]}.{parts[1]}"
    raise ModelLoadError(str(f.path), f"tensor {name}: not part of a Llama-style decoder")


def dequantize_tensor(t: ReaderTensor) -> torch.Tensor:
    """The tensor as float32 in PyTorch's row-major shape (GGUF lists dimensions innermost first)."""
    values = dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])
    return torch.from_numpy(np.require(values, np.float32, ["C", "W"]))  # F32 comes back as a read-only view


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head it interleaves the two rotary halves (0, d/2, 1, d/2+1, ...)."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
