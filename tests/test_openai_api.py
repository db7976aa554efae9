"""The OpenAI-compatible API, driven by the official `openai` client against a real server."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.model.loader import LoadedModel, load_model
from kvscope.backend.engine.reference import reference_generate
from kvscope.backend.server.app import create_app
from kvscope.backend.model.chat import ChatTemplateError, render_speeches, render_template, special_tokens
from kvscope.backend.server.limits import ServiceLimits
from kvscope.backend.server.manager import RunManager
from kvscope.backend.server.serve import serve_in_thread
from tests.server_helpers import client, manager, model_name, url  # noqa: F401 (fixtures)

PROMPT = "ROMEO:\n"
CHAT = [{"role": "user", "content": "Good morrow, fair lady."}]




@pytest.fixture(scope="module")
def loaded(model_name: str) -> LoadedModel:
    return load_model(model_name)  # its own copy: the reference runs beside the server's engine


def test_models_lists_the_served_model_first(client: openai.OpenAI, model_name: str) -> None:
    models = client.models.list().data
    assert (models[0].id, models[0].object, models[0].owned_by) == (model_name, "model", "kvscope")
    assert [m.id for m in models] == RunManager(model_name).api_models()  # and the others it serves by name
    # vLLM's max_model_len (what clients size prompts by), the very limit a request is held to
    assert all(m.max_model_len == EngineConfig().max_model_len for m in models)
    assert client.models.retrieve(model_name).max_model_len == EngineConfig().max_model_len


def test_a_greedy_completion_is_what_the_reference_generates(client, model_name, loaded: LoadedModel) -> None:
    tok = loaded.tokenizer
    ids = reference_generate(loaded.model, tok.encode(PROMPT), 24, SamplingParams(temperature=0.0), tok.eos_token_ids)
    expected = tok.decode([t for t in ids if t not in tok.eos_token_ids])

    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=24, temperature=0)

    assert r.object == "text_completion"
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == ("stop" if ids[-1] in tok.eos_token_ids else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(tok.encode(PROMPT)), len(ids))


def test_streamed_deltas_add_up_to_the_plain_completion(client, model_name) -> None:
    plain = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=24, temperature=0)
    chunks = list(client.completions.create(model=model_name, prompt=PROMPT, max_tokens=24, temperature=0,
                                            stream=True))
    assert len(chunks) > 2
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_chat_with_and_without_stream(client, model_name) -> None:
    plain = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=24, temperature=0,
                                                 stream=True))

    assert plain.object == "chat.completion"
    assert plain.choices[0].message.role == "assistant" and plain.choices[0].message.content
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_n_with_a_seed_gives_n_reproducible_choices(client, model_name) -> None:
    def sample() -> list[tuple[int, str]]:
        r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, n=2, seed=7)
        return [(c.index, c.text) for c in r.choices]

    first = sample()
    assert [i for i, _ in first] == [0, 1]
    assert sample() == first


def test_n_choices_share_the_prompt_blocks_in_the_engine(client, url: str, model_name: str) -> None:
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, n=3, temperature=1.0, seed=1,
                                  stream=False)
    trace = [json.loads(line) for line in httpx.get(f"{url}/api/runs/api/trace").text.splitlines()]
    forks = [e for e in trace if e["type"] == "seq_fork" and e["request_id"] == r.id]
    assert len(forks) == 2 and len(r.choices) == 3  # one prompt computed, two siblings forked from it
    assert any(e["type"] == "block_share" and e["reason"] == "fork" and e["request_id"] == r.id for e in trace)
    done = next(e for e in trace if e["type"] == "request_finished" and e["request_id"] == r.id)
    assert r.usage.completion_tokens == sum(len(o["output_token_ids"]) for o in done["outputs"])


def test_a_stop_string_cuts_the_text_before_it(client, model_name) -> None:
    full = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = full.split()[2]
    expected = full[: full.index(stop)]

    cut = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    streamed = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                         stream=True)

    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (expected, "stop")
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_logprobs_name_each_token_and_its_alternatives(client, model_name) -> None:
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(p <= 0 for p in lp.token_logprobs)
    # Greedy: the chosen token is the most likely of the alternatives.
    assert all(0 < len(top) <= 3 and max(top, key=top.get) == t for t, top in zip(lp.tokens, lp.top_logprobs))

    chat = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 for e in content)


def test_refused_requests_are_openai_400s(client, model_name) -> None:
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=model_name, prompt="To be or not to be. " * 400, max_tokens=4)
    with pytest.raises(openai.BadRequestError) as cold:
        client.completions.create(model=model_name, prompt=PROMPT, temperature=-1)

    assert too_long.value.body["param"] == "prompt" and "max_model_len" in too_long.value.body["message"]
    assert (cold.value.body["param"], cold.value.body["type"]) == ("temperature", "invalid_request_error")


def test_a_client_that_leaves_mid_stream_aborts_its_request(url: str, model_name: str) -> None:
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        first = next(r.iter_lines())
    rid = json.loads(first.removeprefix("data: "))["id"]

    deadline = time.monotonic() + 20
    while (view := httpx.get(f"{url}/api/runs/api").json()["requests"][rid])["finish_reason"] is None:
        assert time.monotonic() < deadline, "the engine kept generating for a client that left"
        time.sleep(0.05)
    assert view["finish_reason"] == "abort" and len(view["output_token_ids"]) < 500


def test_the_dashboard_sees_api_requests_in_the_api_run(client, url: str, model_name: str) -> None:
    text = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4)
    chat = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=4)

    snapshot = httpx.get(f"{url}/api/runs/api").json()

    assert snapshot["kind"] == "api"
    assert snapshot["requests"][text.id]["output_text"] == text.choices[0].text
    assert snapshot["requests"][chat.id]["prompt_text"].startswith("ROMEO:\nGood morrow, fair lady.\n")


def test_with_a_server_token_the_api_key_must_be_that_token(model_name: str) -> None:
    with serve_in_thread(create_app(RunManager(default_model=model_name), token="s3cret")) as base:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0).completions.create(
                model=model_name, prompt=PROMPT, max_tokens=1)
        ok = openai.OpenAI(base_url=base + "/v1", api_key="s3cret", max_retries=0).completions.create(
            model=model_name, prompt=PROMPT, max_tokens=1)
    assert ok.usage.completion_tokens == 1


def test_a_batch_of_prompts_gives_n_choices_per_prompt_in_order(client, model_name) -> None:
    prompts = [PROMPT, "KING RICHARD:\n", "A"]
    alone = [client.completions.create(model=model_name, prompt=p, max_tokens=6, temperature=0).choices[0].text
             for p in prompts]
    lengths = [client.completions.create(model=model_name, prompt=p, max_tokens=1).usage.prompt_tokens for p in prompts]

    r = client.completions.create(model=model_name, prompt=prompts, max_tokens=6, temperature=0, n=2)
    streamed = list(client.completions.create(model=model_name, prompt=prompts, max_tokens=6, temperature=0, n=2,
                                              stream=True, stream_options={"include_usage": True}))

    assert [(c.index, c.text) for c in r.choices] == [(i, alone[i // 2]) for i in range(6)]
    texts = {i: "".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == i) for i in range(6)}
    assert texts == {i: alone[i // 2] for i in range(6)}
    assert r.usage.completion_tokens == streamed[-1].usage.completion_tokens
    assert r.usage.prompt_tokens == streamed[-1].usage.prompt_tokens == sum(lengths)  # each prompt counted once
    ids = client.completions.create(model=model_name, prompt=[[7, 8, 9], [10, 11]], max_tokens=2, temperature=0)
    assert [c.index for c in ids.choices] == [0, 1] and ids.usage.prompt_tokens == 5
    with pytest.raises(openai.BadRequestError) as too_many:
        client.completions.create(model=model_name, prompt=[PROMPT] * 5, max_tokens=1, n=16)
    with pytest.raises(openai.BadRequestError) as mixed:
        client.completions.create(model=model_name, prompt=[PROMPT, [7, 8]], max_tokens=1)
    assert too_many.value.body["param"] == "n" and mixed.value.body["param"] == "prompt"


def test_echo_returns_the_prompt_and_its_logprobs(client, model_name, loaded: LoadedModel) -> None:
    import torch

    from kvscope.backend.engine.reference import next_token_logits

    ids = loaded.tokenizer.encode(PROMPT + "Good")
    plain = client.completions.create(model=model_name, prompt=PROMPT + "Good", max_tokens=4, temperature=0)
    r = client.completions.create(model=model_name, prompt=PROMPT + "Good", max_tokens=4, temperature=0,
                                  echo=True, logprobs=2)
    scored = client.completions.create(model=model_name, prompt=PROMPT + "Good", max_tokens=0, echo=True, logprobs=1)

    choice, lp = r.choices[0], r.choices[0].logprobs
    assert choice.text == PROMPT + "Good" + plain.choices[0].text
    assert "".join(lp.tokens) == choice.text and lp.text_offset[len(ids)] == len(PROMPT + "Good")
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    expected = [torch.log_softmax(next_token_logits(loaded.model, ids[:i]), -1)[ids[i]].item()
                for i in range(1, len(ids))]
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=1e-4)
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == logprob and len(top) in (2, 3)  # the top 2, and the token itself as vLLM lists it
    assert (scored.choices[0].text, scored.choices[0].finish_reason) == (PROMPT + "Good", "length")
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (len(ids), 0)
    chunks = list(client.completions.create(model=model_name, prompt=PROMPT + "Good", max_tokens=4, temperature=0,
                                            echo=True, stream=True))
    assert chunks[0].choices[0].text == PROMPT + "Good"
    assert "".join(c.choices[0].text for c in chunks) == choice.text


def test_logit_bias_ids_are_checked_and_the_bias_applied(client, model_name, loaded: LoadedModel) -> None:
    vocab = loaded.config.vocab_size
    with pytest.raises(openai.BadRequestError) as outside:
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2, logit_bias={str(vocab): 5})
    with pytest.raises(openai.BadRequestError) as too_strong:
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2, logit_bias={"5": 101})
    assert outside.value.body["param"] == "logit_bias" and str(vocab) in outside.value.body["message"]
    assert too_strong.value.body["param"].startswith("logit_bias")
    forced = loaded.tokenizer.encode(" castle")[0]
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=3, temperature=0,
                                  logit_bias={str(forced): 100})
    assert r.choices[0].text == loaded.tokenizer.decode([forced] * 3)


def test_a_model_by_id_and_an_unknown_one(client, url: str, model_name: str) -> None:
    if "/" not in model_name:
        assert client.models.retrieve(model_name).id == model_name
    with pytest.raises(openai.NotFoundError) as unknown:
        client.models.retrieve("gpt-4")
    assert (unknown.value.body["code"], unknown.value.body["param"]) == ("model_not_found", "model")


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools.0.function.parameters"),
    ({"tool_choice": "auto"}, "tool_choice"),  # without tools
    ({"functions": [{"name": "f"}]}, "functions"),  # OpenAI's deprecated form of tools
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"store": True}, "store"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"stream_options": {"include_obfuscation": False}}, "stream_options.include_obfuscation"),  # the Responses API's
    ({"max_tokens": 5000}, "max_tokens"),  # beyond the context
    ({"frobnicate": 1}, "frobnicate"),
])
def test_what_kvscope_does_not_implement_is_a_400_naming_it(client, model_name, extra, param) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model_name, messages=CHAT, extra_body=extra)
    assert refused.value.body["param"] == param and refused.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize("extra, param", [
    ({"suffix": "the end"}, "suffix"), ({"best_of": 3}, "best_of"), ({"max_tokens": 2000}, "max_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"user": "u" * 300}, "user"),
])
def test_completion_parameters_kvscope_cannot_honour_are_400s(client, model_name, extra, param) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2, extra_body=extra)
    assert refused.value.body["param"] == param
    ok = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=1, response_format={"type": "text"},
                                        tools=None, user="someone")  # the defaults are fine, nulls are absent
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_every_error_under_v1_has_openais_shape(url: str) -> None:
    def error(response: httpx.Response) -> tuple[int, set]:
        return response.status_code, set(response.json()["error"])

    shape = {"message", "type", "param", "code"}
    assert error(httpx.get(f"{url}/v1/nope")) == (404, shape)
    assert error(httpx.get(f"{url}/v1/completions")) == (405, shape)
    form = httpx.post(f"{url}/v1/completions", data={"prompt": "x"})
    assert error(form) == (415, shape)
    assert error(httpx.post(f"{url}/v1/completions", content=b"{nope", headers={"content-type": "application/json"})) \
        == (400, shape)
    deep = '{"prompt": ' + "[" * 5000 + "]" * 5000 + "}"
    assert error(httpx.post(f"{url}/v1/completions", content=deep, headers={"content-type": "application/json"})) \
        == (400, shape)
    assert error(httpx.get(f"{url}/v1/models/nope")) == (404, shape)


# The answers, without what differs from one call to the next (ids, times).
def answer(response) -> dict:
    return response.model_dump(exclude={"id", "created", "system_fingerprint"})


def chunks_of(stream) -> list[dict]:
    return [answer(c) for c in stream]


def test_every_events_level_serves_the_same_answers(client, model_name) -> None:
    """The API answers from the engine's own output stream, not from the trace: a server whose API run
    records no events (serve --api-events off) gives the same completions, streamed chunks and logprobs."""
    calls = [
        lambda c: answer(c.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                              logprobs=3)),
        lambda c: chunks_of(c.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                                 logprobs=2, stop=["\n\n"], stream=True)),
        lambda c: answer(c.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                              seed=7, n=2)),
        lambda c: chunks_of(c.chat.completions.create(model=model_name, messages=CHAT, max_tokens=10, temperature=0,
                                                      logprobs=True, top_logprobs=2, stream=True)),
    ]
    limits = ServiceLimits(api_events="off")
    with serve_in_thread(create_app(RunManager(default_model=model_name, limits=limits))) as quiet_url:
        quiet = openai.OpenAI(base_url=quiet_url + "/v1", api_key="none", max_retries=0, timeout=60)
        for call in calls:
            assert call(quiet) == call(client)
        trace = httpx.get(f"{quiet_url}/api/runs/api/trace").text
        assert '"type":"token"' not in trace and '"type":"request_finished"' in trace  # off kept no token events


# ---- the chat template, without a server -----------------------------------------------------------------


def test_the_default_chat_template_writes_speeches_as_the_demo_models_learned_them() -> None:
    messages = [{"role": "system", "content": "Verona."}, {"role": "user", "content": "Hello?\n"},
                {"role": "user", "name": "Tybalt", "content": "Draw!"}]
    assert render_speeches(messages, "<eos>") == \
        "CHORUS:\nVerona.\n<eos>ROMEO:\nHello?\n<eos>TYBALT:\nDraw!\n<eos>JULIET:\n"


def test_a_hugging_face_chat_template_renders_with_the_folders_special_tokens(tmp_path) -> None:
    template = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}{% endif %}"
                "<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    tokens = special_tokens(tmp_path)

    assert render_template(template, [{"role": "user", "content": "hi"}], tokens) == "<user>hi</s><assistant>"
    with pytest.raises(ChatTemplateError, match="no system"):
        render_template(template, [{"role": "system", "content": "x"}], tokens)


# ---- tools and grammars (structured.py, tools.py, tool_parser.py) -----------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALLED = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Verona"}'}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": "Rain."}]


def test_tools_with_auto_give_a_well_formed_answer_plain_and_streamed(client, model_name) -> None:
    kwargs = dict(model=model_name, messages=CHAT, tools=TOOLS, tool_choice="auto", max_tokens=12, temperature=0)
    plain = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    choice = plain.choices[0]
    calls = choice.message.tool_calls or []
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert all(c.id.startswith("call_") and json.loads(c.function.arguments) is not None for c in calls)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == (choice.message.content or "")
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_a_history_with_a_call_and_its_result_is_answered(client, model_name) -> None:
    r = client.chat.completions.create(model=model_name, messages=CALLED, tools=TOOLS, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("extra, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
    ({"tools": TOOLS * 2}, "tools"),
    ({"parallel_tool_calls": "maybe"}, "parallel_tool_calls"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": {"description": "x" * 100_000}}, "guided_json"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
])
def test_malformed_tools_and_grammars_are_400s_naming_the_field(client, model_name, extra, param) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=1, extra_body=extra)
    assert refused.value.body["param"] == param and "xxxx" not in refused.value.body["message"]
    ok = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=1)
    assert ok.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("messages, param", [
    (CALLED[:2] + [{"role": "tool", "content": "Rain."}], "messages.2.tool_call_id"),
    ([CHAT[0], {**CALLED[1], "role": "user"}], "messages.1.tool_calls"),
    ([*CHAT, {**CALLED[1], "tool_calls": [{**CALLED[1]["tool_calls"][0], "function": {"name": "f", "arguments": "{"}}]}],
     "messages.1.tool_calls.0.function.arguments"),
])
def test_a_malformed_tool_history_is_a_400_naming_the_message(client, model_name, messages, param) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model_name, messages=messages, max_tokens=1)
    assert refused.value.body["param"] == param


async def test_an_answer_forwards_the_engines_text_deltas_and_what_is_left_comes_with_the_finish() -> None:
    """generation.py sends each Token's own text (stop strings and split characters are the engine's:
    backend/engine/detokenizer.py); text the engine hands out only as a sequence ends (a beam's, say)
    comes with that choice's finish, so a stream's deltas always add up to the answer."""
    from types import SimpleNamespace

    from kvscope.backend.engine.request_output import Arrived, Finished, Forked, Token
    from kvscope.backend.server.generation import Generation

    tokenizer = SimpleNamespace(eos_token_ids=[2], token_text=lambda t: f"<{t}>")
    gen = Generation(SimpleNamespace(loaded=SimpleNamespace(tokenizer=tokenizer)), 2, "cmpl")
    rid = gen.request_ids[0]
    ends = ({"seq_id": 0, "output_token_ids": [10, 12, 2], "output_text": "Hello", "finish_reason": "eos"},
            {"seq_id": 1, "output_token_ids": [11], "output_text": "Wor", "finish_reason": "length"})
    for output in [Arrived(rid, 0, 3), Forked(rid, 1), Token(rid, 0, 10, -0.1, None, text="Hel"),
                   Token(rid, 1, 11, -0.2, None, text=""), Token(rid, 0, 12, -0.3, None, text="lo"),
                   Token(rid, 0, 2, -0.01, None), Finished(rid, "eos", ends)]:
        gen.queue.put_nowait(output)
    updates = [(c.index, delta, token is None) async for c, delta, token in gen.updates()]
    assert updates == [(0, "Hel", False), (1, "", False), (0, "lo", False), (0, "", True), (1, "Wor", True)]
    assert [(c.text, c.finish_reason, len(c.tokens)) for c in gen.choices] == \
        [("Hello", "stop", 2), ("Wor", "length", 1)]
