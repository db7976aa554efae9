"""What tools expect of a vLLM-style server beside the completions: probes, tokenize, and the stream's framing.

Against a live server on the demo model: /health (503 while the model loads or after its run failed,
200 once it serves), /version, /tokenize and /detokenize in vLLM's shapes (the ids the completion and
chat routes feed the model), server-sent events framed `\\n\\n`, `usage: null` before the usage chunk,
vLLM's `continuous_usage_stats`, roles and content parts refused by name, and top_logprobs that list
the sampled token with the same value as its own logprob.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from kvscope.backend.server.manager import API_RUN_ID
from tests.server_helpers import client, manager, model_name, served_model, url, wait_for  # noqa: F401 (fixtures)

MODEL = served_model()
CHAT = [{"role": "user", "content": "Good morrow, fair lady."}]
WAIT_S = 60


def healthy(url: str) -> int:
    """/health's status once it stops saying 503 (bounded)."""
    deadline = time.monotonic() + WAIT_S
    while (status := httpx.get(url + "/health").status_code) == 503 and time.monotonic() < deadline:
        time.sleep(0.1)
    return status


def test_health_is_503_until_the_model_serves_then_200_with_no_body(manager, url) -> None:
    first = httpx.get(url + "/health")
    assert first.status_code in (200, 503)
    if first.status_code == 503:  # nothing has asked for the model yet: the probe started loading it
        assert first.json()["status"] == "loading" and first.headers["retry-after"]
    assert healthy(url) == 200 and httpx.get(url + "/health").content == b""
    assert httpx.get(url + "/health").headers["content-type"].startswith("text/plain")  # an empty body is not JSON
    assert manager.get(API_RUN_ID) is not None


def test_health_is_503_after_the_run_failed_and_200_once_a_fresh_one_serves(manager, url, monkeypatch) -> None:
    assert healthy(url) == 200
    start = manager._start_api_run

    def refused(*args, **kwargs):
        raise RuntimeError("no room for the model")

    monkeypatch.setattr(manager, "_start_api_run", refused)
    manager.get(API_RUN_ID).fail("a test broke it")
    answer = httpx.get(url + "/health")
    # 503 at once; its status is "failed", or "loading" while the restart the probe began is still under way
    # (the failed run is gone, the refusal not yet recorded: CI caught that moment twice)
    assert answer.status_code == 503 and answer.json()["status"] in ("failed", "loading")
    wait_for(lambda: "no room" in (httpx.get(url + "/health").json().get("error") or ""), "/health says why")
    failed = httpx.get(url + "/health")
    assert failed.status_code == 503 and failed.json()["status"] == "failed"
    assert "no room for the model" in failed.json()["error"]  # why, for the operator
    monkeypatch.setattr(manager, "_start_api_run", start)
    assert healthy(url) == 200


def test_version_names_the_package(url) -> None:
    assert httpx.get(url + "/version").json()["version"]


def test_tokenize_gives_the_ids_the_completion_and_chat_routes_feed_the_model(url, client) -> None:
    prompt = httpx.post(url + "/tokenize", json={"prompt": "ROMEO:\n", "return_token_strs": True}).json()
    completion = client.completions.create(model=MODEL, prompt="ROMEO:\n", max_tokens=1)
    assert prompt["count"] == len(prompt["tokens"]) == completion.usage.prompt_tokens
    assert "".join(prompt["token_strs"]) == "ROMEO:\n" and prompt["max_model_len"] > 0
    chat = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": CHAT}).json()
    answer = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert chat["count"] == answer.usage.prompt_tokens and chat["token_strs"] is None
    back = httpx.post(url + "/detokenize", json={"tokens": prompt["tokens"]}).json()
    assert back == {"prompt": "ROMEO:\n"}


def test_developer_is_the_system_role_and_other_roles_are_refused_by_name(url, client) -> None:
    def ids(role: str) -> list[int]:
        return httpx.post(url + "/tokenize", json={"messages": [{"role": role, "content": "Be brief."}, *CHAT]}) \
            .json()["tokens"]

    assert ids("developer") == ids("system")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}], max_tokens=1)
    assert refused.value.body["param"] == "messages.0.role" and "'developer'" in refused.value.body["message"]


@pytest.mark.parametrize("part, words", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "images are not supported by this model"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio is not supported by this model"),
    ({"type": "hologram"}, "'hologram' parts are not supported"),
])
def test_content_parts_a_text_model_cannot_read_are_refused_saying_so(client, part, words) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert words in refused.value.body["message"] and refused.value.body["param"] == "messages.0.content.1.type"


@pytest.mark.parametrize("body, param", [
    ({}, None), ({"prompt": "x", "messages": CHAT}, None), ({"prompt": 5}, "prompt"),
    ({"messages": CHAT, "add_generation_prompt": False}, "add_generation_prompt"),
    ({"prompt": "x", "continue_final_message": True}, "continue_final_message"),
    ({"prompt": "x", "model": "no-such-model"}, "model"), ({"prompt": "x", "wizard": 1}, "wizard"),
])
def test_a_tokenize_body_it_cannot_honour_is_a_400_naming_the_field(url, body, param) -> None:
    answer = httpx.post(url + "/tokenize", json=body)
    assert answer.status_code in (400, 404) and answer.json()["error"]["param"] == param


@pytest.mark.parametrize("tokens, param", [([10**9], "tokens"), ([-1], "tokens.0"), (["a"], "tokens.0"),
                                           ("abc", "tokens")])
def test_detokenize_refuses_ids_outside_the_vocabulary(url, tokens, param) -> None:
    answer = httpx.post(url + "/detokenize", json={"tokens": tokens})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param
    assert healthy(url) == 200


def events_of(url: str, body: dict) -> tuple[str, list[dict]]:
    """The raw text of a streamed answer and its chunks."""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as answer:
        raw = answer.read().decode()
    payloads = [line.removeprefix("data: ") for line in raw.split("\n\n") if line]
    assert payloads[-1] == "[DONE]"
    return raw, [json.loads(p) for p in payloads[:-1]]


def test_events_end_with_a_blank_line_of_newlines_only(url) -> None:
    raw, chunks = events_of(url, {"messages": CHAT, "max_tokens": 8, "stream": True})
    assert "\r" not in raw and raw.endswith("data: [DONE]\n\n") and len(chunks) > 2
    assert all("usage" not in c for c in chunks)  # no include_usage: no usage key at all


def test_with_include_usage_every_chunk_before_the_last_has_usage_null(url) -> None:
    _, chunks = events_of(url, {"messages": CHAT, "max_tokens": 8, "stream": True,
                                "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


def test_continuous_usage_stats_give_the_usage_so_far_on_every_chunk(url) -> None:
    _, chunks = events_of(url, {"messages": CHAT, "max_tokens": 8, "stream": True, "temperature": 0,
                                "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    so_far = [c["usage"]["completion_tokens"] for c in chunks]
    assert so_far == sorted(so_far) and so_far[0] == 0 and so_far[-2] == so_far[-1] == chunks[-1]["usage"][
        "completion_tokens"]
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {chunks[-1]["usage"]["prompt_tokens"]}
    content_chunks = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len({c["usage"]["completion_tokens"] for c in content_chunks}) == len(content_chunks), "one token each"


def test_top_logprobs_list_the_sampled_token_with_its_own_logprob(client) -> None:
    completion = client.completions.create(model=MODEL, prompt="ROMEO:\n", max_tokens=12, temperature=1.5, seed=3,
                                           logprobs=1, extra_body={"ignore_eos": True})
    lp = completion.choices[0].logprobs
    outside = 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == logprob  # one token, one value
        outside += len(top) == 2  # the sampled token was not the likeliest: listed beside the top 1
    assert outside > 0, "at temperature 1.5 some token is not the likeliest (the check can fail)"
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, logprobs=True, top_logprobs=3)
    for entry in chat.choices[0].logprobs.content:
        same = [t.logprob for t in entry.top_logprobs if t.token == entry.token]
        assert same in ([], [entry.logprob])


def test_a_request_arrives_when_the_server_receives_it_not_when_the_step_under_way_ends(manager, url, client,
                                                                                        monkeypatch) -> None:
    """TTFT counts the wait for the iteration already running, as the client sees it (and vLLM counts it).
    The slow step holds the worker for a second after the second request has arrived (the server stamps
    its arrival before it waits for the worker): its TTFT is at least that second, however loaded the machine."""
    assert healthy(url) == 200
    api = manager.get(API_RUN_ID)
    engine = api.engine
    step, in_step = engine.step, threading.Event()

    def slow_step():
        if not in_step.is_set():
            in_step.set()
            wait_for(lambda: api.requests.adds_pending > 0, "the second request arrived")
            time.sleep(1.0)  # the step's own work, slow: what the second request waits for
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    first = threading.Thread(target=lambda: client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=2))
    first.start()
    assert in_step.wait(WAIT_S)
    answer = client.completions.create(model=MODEL, prompt="JULIET:", max_tokens=2)
    first.join(WAIT_S)
    trace = httpx.get(url + "/api/runs/api/trace").text.splitlines()
    done = next(json.loads(line) for line in trace if answer.id in line and '"request_finished"' in line)
    assert done["ttft_s"] >= 0.8  # it waited for the slow step before the worker could take it


def test_usage_says_how_many_prompt_tokens_the_prefix_cache_held(client) -> None:
    prompt = "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun." * 2
    again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=1)
    twice = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens < twice.usage.prompt_tokens_details.cached_tokens
    assert 0 < twice.usage.prompt_tokens_details.cached_tokens < twice.usage.prompt_tokens  # full blocks, not all
    answer = client.responses.create(model=MODEL, input=[{"role": "user", "content": prompt}], max_output_tokens=1)
    assert answer.usage.input_tokens_details.cached_tokens == twice.usage.prompt_tokens_details.cached_tokens
