"""A live server on the demo model, one per test module: the fixtures the API tests share.

Import them into a test module by name (`from tests.live_server import client, manager, model_name,
url  # noqa: F401`); each module gets its own server, bound to 127.0.0.1 on a free port.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from kvscope.backend.model.loader import SHIPPED_MODELS_DIR
from kvscope.backend.server.app import create_app
from kvscope.backend.server.manager import RunManager
from kvscope.backend.server.serve import serve_in_thread


def served_model() -> str:
    # The shipped demo model is retrained from time to time; an earlier copy stands in meanwhile.
    return "demo" if (SHIPPED_MODELS_DIR / "demo" / "model.safetensors").is_file() else "/tmp/demo800"


@pytest.fixture(scope="module")
def model_name() -> str:
    return served_model()


@pytest.fixture(scope="module")
def manager(model_name: str) -> Iterator[RunManager]:
    manager = RunManager(default_model=model_name)
    yield manager
    manager.stop_all()


@pytest.fixture(scope="module")
def url(manager: RunManager) -> Iterator[str]:
    with serve_in_thread(create_app(manager)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
