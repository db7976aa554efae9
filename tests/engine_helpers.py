"""Helpers for driving the engine in tests: a fixed workload and a loop that checks every step."""

from __future__ import annotations

import random

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.engine import Engine
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.events.bus import EventBus
from kvscope.backend.events.state import RunState
from kvscope.backend.model.loader import LoadedModel
from kvscope.backend.scenario import draw_prompt

GREEDY = SamplingParams(temperature=0.0)


def mixed_workload(loaded: LoadedModel, count: int = 16, seed: int = 0) -> list[tuple[str, int, list[int], int]]:
    """(request_id, arrival_step, prompt ids, max_tokens): different lengths and arrival steps."""
    rng = random.Random(seed)
    return [(f"r{i}", rng.randrange(0, 12), draw_prompt(loaded.tokenizer, rng.randrange(2, 90), rng),
             rng.randrange(1, 24)) for i in range(count)]


def run_engine(loaded: LoadedModel, config: EngineConfig, workload, sampling=GREEDY, check=True,
               replay: RunState | None = None, events: list | None = None, max_steps: int = 5000,
               draft_model: LoadedModel | None = None) -> Engine:
    """Deliver the workload at its arrival steps and step to the end, checking block invariants."""
    bus = EventBus(level=config.events)
    if events is not None:
        bus.subscribe(events.append)
    if replay is not None:
        bus.subscribe(replay.apply)
    engine = Engine(loaded, config, bus, draft=draft_model)
    engine.emit_header()
    pending = sorted(workload, key=lambda w: w[1])
    while (pending or engine.has_unfinished()) and engine.step_no < max_steps:
        while pending and pending[0][1] <= engine.step_no:
            rid, _, prompt, max_tokens = pending.pop(0)
            params = sampling(rid) if callable(sampling) else sampling
            engine.add_request(rid, prompt, max_tokens, params)
        engine.step()
        if check:
            engine.blocks.check_invariants(engine.live_sequences())
            if replay is not None:
                assert_replay_matches(replay, engine)
    assert not pending and not engine.has_unfinished(), "engine did not finish the workload"
    return engine


def assert_replay_matches(state: RunState, engine: Engine) -> None:
    """The reducer, fed only events, agrees with the block manager on tables and the free list."""
    tables = {seq.seq_id: engine.blocks.block_table(seq.seq_id) for seq in engine.live_sequences()}
    live = {seq_id: table for seq_id, table in tables.items() if table}
    assert {k: v for k, v in state.block_tables.items() if v} == live
    assert list(state.free_blocks) == engine.blocks.free_block_ids


def outputs(engine: Engine) -> dict[str, list[int]]:
    return {rid: r.seq.output_token_ids for rid, r in engine.requests.items()}
