"""Shared fixtures: models are loaded once per session (importing and loading takes seconds)."""

from __future__ import annotations

import pytest
import torch

from backend.model.loader import LoadedModel, load_model


@pytest.fixture(scope="session", autouse=True)
def _torch_threads() -> None:
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def demo() -> LoadedModel:
    return load_model("demo")


@pytest.fixture(scope="session")
def draft() -> LoadedModel:
    return load_model("demo-draft")
