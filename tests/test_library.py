"""The run library: finished runs saved to a folder, listed, renamed, deleted and reopened exactly, across restarts.

The module alone (library.py) on made-up traces, then the API on real runs of the tiny model: two
servers on one folder stand for a restart, and a reopened run's record (state and every view's past)
is compared with the one the original run's events build.
"""

import gc
import itertools
import json
import weakref
import logging
from collections import deque
from types import SimpleNamespace

import pytest

from kvscope.backend.events.record import RunRecord
from kvscope.backend.events.trace import parse_trace
from kvscope.backend.server import library as library_module
from kvscope.backend.server.library import Entry, LibraryError, RunLibrary, run_facts
from kvscope.backend.server.limits import ServiceLimits
from kvscope.backend.server.manager import RunManager
from kvscope.backend.server.replay_copies import copy_bytes, state_bytes
from kvscope.frontend.client import resynced_record
from tests.server_helpers import in_process, scenario, wait_for

MB = 1024**2


def fake_trace(run_id: str, lines: int = 3) -> str:
    header = {"type": "header", "seq": 0, "step": -1, "t": 0.0, "run_id": run_id}
    return "\n".join([json.dumps(header)] + [json.dumps({"type": "x", "seq": i, "step": i, "t": 0.0})
                                               for i in range(1, lines)]) + "\n"


def facts(run_id: str, **extra) -> dict:
    return {**run_facts(run_id, {"name": "shared-prefix"}, {"name": "demo"}, {"engine.block_size": 8}, False, 12, 3,
                        None), **extra}


# ---- the module ---------------------------------------------------------------------------------------


@pytest.fixture
def ticking(monkeypatch):
    """The library's clock reads 1 s, 2 s, 3 s ...: runs saved one after another are newer one by one,
    with no sleep between them to make the wall clock move."""
    ticks = itertools.count(1)
    monkeypatch.setattr(library_module, "time", SimpleNamespace(time=lambda: float(next(ticks))))


def test_a_saved_run_is_a_trace_and_a_sidecar_and_lists_with_its_facts(tmp_path):
    library = RunLibrary(tmp_path)
    entry = library.save(fake_trace("a1"), **facts("a1"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a1.json", "a1.jsonl"]
    assert (tmp_path / "a1.jsonl").read_text() == fake_trace("a1")
    assert entry.scenario == "shared-prefix" and entry.model == "demo" and entry.steps == 12 and entry.requests == 3
    assert entry.overrides == {"engine.block_size": 8} and entry.name == "shared-prefix"
    assert entry.trace_bytes == len(fake_trace("a1"))
    assert RunLibrary(tmp_path).entries() == [entry]  # another instance on the folder: a restart
    assert library.trace_text("a1") == fake_trace("a1")


def test_entries_list_newest_first_and_rename_and_delete_change_only_theirs(tmp_path, ticking):
    library = RunLibrary(tmp_path)
    for rid in ("a1", "b2", "c3"):
        library.save(fake_trace(rid), **facts(rid))
    assert [e.id for e in library.entries()] == ["c3", "b2", "a1"]
    assert library.rename("b2", "  Week 3: prefix caching  ").name == "Week 3: prefix caching"
    library.delete("a1")
    assert [(e.id, e.name) for e in RunLibrary(tmp_path).entries()][1] == ("b2", "Week 3: prefix caching")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b2.json", "b2.jsonl", "c3.json", "c3.jsonl"]


def test_saving_a_run_again_replaces_its_entry(tmp_path):
    library = RunLibrary(tmp_path)
    library.save(fake_trace("a1"), **facts("a1"))
    library.save(fake_trace("a1", lines=5), **facts("a1", steps=40))
    assert [(e.id, e.steps) for e in library.entries()] == [("a1", 40)]
    assert library.trace_text("a1") == fake_trace("a1", lines=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a1.json", "a1.jsonl"]


def test_the_oldest_entries_are_evicted_to_stay_within_the_size_limit(tmp_path, ticking):
    size = len(fake_trace("a1", lines=200))
    library = RunLibrary(tmp_path, max_mb=2.5 * size / MB)
    for rid in ("a1", "b2", "c3", "d4"):
        library.save(fake_trace(rid, lines=200), **facts(rid))
    assert [e.id for e in library.entries()] == ["d4", "c3"]
    assert not (tmp_path / "a1.jsonl").exists() and not (tmp_path / "b2.json").exists()
    assert library.save(fake_trace("e5", lines=2000), **facts("e5")) is None  # larger than the whole library
    assert [e.id for e in library.entries()] == ["d4", "c3"]


@pytest.mark.parametrize("bad", ["../etc/passwd", "A1", "a1.json", "", "a" * 65, "a/b", "-a"])
def test_ids_that_are_not_file_stems_are_refused_naming_the_field(tmp_path, bad):
    library = RunLibrary(tmp_path)
    with pytest.raises(LibraryError) as e:
        library.get(bad)
    assert e.value.field == "id" and not e.value.missing


@pytest.mark.parametrize("name", ["", "   ", "x" * 121, "a\nb",
                                  "a\x7fb", "week \u202egnp.exe", "a\u200bb", "<script>alert(1)</script>"])
def test_names_are_one_line_of_bounded_length_without_control_formatting_or_markup(tmp_path, name):
    """DEL, U+202E (which shows what follows it reversed), a zero-width space and a tag were names (#35)."""
    library = RunLibrary(tmp_path)
    library.save(fake_trace("a1"), **facts("a1"))
    with pytest.raises(LibraryError, match="^name: "):
        library.rename("a1", name)


def test_hostile_and_cut_files_in_the_folder_are_skipped_with_a_logged_line(tmp_path, caplog):
    library = RunLibrary(tmp_path)
    good = library.save(fake_trace("a1"), **facts("a1"))
    library.save(fake_trace("b2"), **facts("b2"))
    with (tmp_path / "b2.jsonl").open("r+") as f:  # cut short, as by a full disk or a kill
        f.truncate(10)
    (tmp_path / "c3.json").write_text("{not json")
    entry = json.loads((tmp_path / "a1.json").read_text())
    (tmp_path / "d4.json").write_text(json.dumps({**entry, "id": "d4", "trace": "../../etc/passwd"}))
    (tmp_path / "e5.json").write_text(json.dumps({**entry, "id": "a1"}))  # names another entry
    (tmp_path / "f6.json").write_text(json.dumps({**entry, "id": "f6", "steps": "many"}))
    (tmp_path / "g7.json").write_text(" " * 70_000)
    (tmp_path / "h8.jsonl").write_text(fake_trace("h8"))  # a save that never wrote its sidecar
    library.save(fake_trace("i9"), **facts("i9"))
    (tmp_path / "i9.json").write_text(json.dumps({**json.loads((tmp_path / "i9.json").read_text()),
                                                  "name": "<img src=x onerror=alert(1)>"}))  # a name edited on disk
    with caplog.at_level(logging.WARNING, logger="kvscope.backend.server.library"):
        assert library.entries() == [good]
    for name in ("b2.json", "c3.json", "d4.json", "e5.json", "f6.json", "g7.json", "i9.json"):
        assert f"library: skipped {name}: " in caplog.text, name
    assert "cut or edited" in caplog.text
    with pytest.raises(LibraryError) as e:
        library.trace_text("d4")
    assert e.value.missing


# ---- the API ------------------------------------------------------------------------------------------


@pytest.fixture
def folder(tmp_path):
    return tmp_path / "library"


def served(tiny_dir, folder):
    return RunManager(default_model=tiny_dir, library=RunLibrary(folder))


def finished_run(client, tiny_dir, overrides=None) -> str:
    body = {"scenario": scenario(tiny_dir), "speed": 0, "overrides": overrides or {}}
    run_id = client.post("/api/runs", json=body).json()["run_id"]
    wait_for(lambda: any(e["id"] == run_id for e in client.get("/api/library").json()["entries"]))
    return run_id


def test_a_finished_run_is_listed_renamed_and_deleted_over_http(tiny_dir, folder):
    manager = served(tiny_dir, folder)
    with in_process(manager) as client:
        run_id = finished_run(client, tiny_dir, {"engine.block_size": 8})
        listed = client.get("/api/library").json()
        [entry] = listed["entries"]
        assert listed["enabled"] and listed["bytes"] == entry["trace_bytes"] > 0
        assert entry["scenario"] == "t" and entry["overrides"] == {"engine.block_size": 8} and not entry["failed"]
        assert entry["steps"] == client.get(f"/api/runs/{run_id}").json()["step"] and entry["requests"] == 4
        assert client.get(f"/api/library/{run_id}").json() == entry
        renamed = client.patch(f"/api/library/{run_id}", json={"name": "Lecture 2"})
        assert renamed.status_code == 200 and renamed.json()["name"] == "Lecture 2"
        assert client.delete(f"/api/library/{run_id}").status_code == 204
        assert client.get("/api/library").json()["entries"] == []
        assert client.get(f"/api/library/{run_id}").status_code == 404


def test_bad_library_requests_are_4xx_naming_the_field(tiny_dir, folder):
    manager = served(tiny_dir, folder)
    with in_process(manager) as client:
        run_id = finished_run(client, tiny_dir)
        r = client.patch(f"/api/library/{run_id}", json={"name": ""})
        assert r.status_code == 400 and r.json()["field"] == "name"
        r = client.patch(f"/api/library/{run_id}", json={"name": "x", "title": "x"})
        assert r.status_code == 400 and r.json()["field"] == "title"
        r = client.patch("/api/library/NOT..AN-ID", json={"name": "x"})
        assert r.status_code == 400 and r.json()["field"] == "id"
        r = client.post("/api/library/feedfeedfeed/open", json={})
        assert r.status_code == 404 and r.json()["field"] == "id"
        r = client.post(f"/api/library/{run_id}/open", json={"speed": -1})
        assert r.status_code == 400 and r.json()["field"] == "speed"
        assert client.delete("/api/library/feedfeedfeed").status_code == 404
        sneaky = client.request("DELETE", f"/api/library/{run_id}", content="x", headers={"content-type": "text/plain"})
        assert sneaky.status_code == 415  # only a DELETE without a body skips the JSON check
    with in_process(RunManager(default_model=tiny_dir)) as client:  # no library
        assert client.get("/api/library").json() == {"enabled": False, "bytes": 0, "max_bytes": 0, "entries": [],
                                                     "pairs": []}
        assert client.post(f"/api/library/{run_id}/open", json={}).status_code == 404


def test_a_run_saved_by_one_server_reopens_exactly_on_the_next(tiny_dir, folder):
    """A restart: every view's past (attention masks, token rows with their distributions, the timeline)
    and the state after the reopened replay are those the original run's events build."""
    first = served(tiny_dir, folder)
    with in_process(first) as client:
        run_id = finished_run(client, tiny_dir)
        original = parse_trace(client.get(f"/api/runs/{run_id}/trace").text)
    second = served(tiny_dir, folder)
    with in_process(second) as client:
        assert [e["id"] for e in client.get("/api/library").json()["entries"]] == [run_id]
        opened = client.post(f"/api/library/{run_id}/open", json={"speed": 0, "paused": False})
        assert opened.status_code == 201 and opened.json()["kind"] == "replay"
        replay_id = opened.json()["run_id"]
        wait_for(lambda: client.get(f"/api/runs/{replay_id}").json()["finished"])
        with client.websocket_connect(f"/ws/runs/{replay_id}") as ws:
            reopened = resynced_record(ws.receive_json())
    expected = RunRecord.from_events(original)
    assert any(expected.history.masks.values()) and any(len(t) > 1 for t in expected.history.tokens.values())
    assert expected.history.masks == reopened.history.masks
    assert as_lists(expected.history.tokens) == as_lists(reopened.history.tokens)
    assert all(e["dist"] for t in reopened.history.tokens.values() for e in t)  # the sampling panel's rows
    assert expected.history.columns == reopened.history.columns
    assert expected.state.snapshot()["requests"] == reopened.state.snapshot()["requests"]
    assert expected.state.snapshot()["block_tables"] == reopened.state.snapshot()["block_tables"]


def test_opens_of_a_saved_run_share_one_parsed_copy_counted_in_bytes(tiny_dir, folder):
    """Each open parsed the trace again: +760 MB per open of a 115 MB trace, six opens 1.2 -> 5.8 GB (#35)."""
    manager = served(tiny_dir, folder)
    with in_process(manager) as client:
        run_id = finished_run(client, tiny_dir)
        size = client.get(f"/api/library/{run_id}").json()["trace_bytes"]
        opened = [client.post(f"/api/library/{run_id}/open", json={}).json()["run_id"] for _ in range(3)]
        copies = {id(manager.get(r).trace_copy) for r in opened}
        assert len(copies) == 1  # one parsed copy, read from disk by the first open
        limits = client.get("/api/limits").json()
        (copy,) = limits["replay_copies"]
        assert copy == {"source": f"library {run_id}", "trace_bytes": size, "runs": 3, "parsed": True,
                        "bytes": copy_bytes(size) + 3 * state_bytes(size)}
        assert limits["replay_bytes"] == copy["bytes"] and limits["max_replay_bytes"] > 0
        for r in opened:
            assert client.delete(f"/api/runs/{r}").status_code == 204  # closed: forgotten at once
        limits = client.get("/api/limits").json()
        assert limits["replay_bytes"] == 0 and limits["replay_copies"] == []
        assert client.delete(f"/api/runs/{opened[0]}").status_code == 404
        assert client.delete("/api/runs/api").status_code in (400, 404)  # the API's run is never closed


def test_a_closed_replay_lets_go_of_its_trace_and_its_reducer_without_a_garbage_collection(tiny_dir, folder):
    """The run and its worker, and the reducer and its table of bound methods, were cycles: a closed replay's
    parsed trace stayed in memory until a full collection, which a server left alone rarely makes."""
    manager = served(tiny_dir, folder)
    with in_process(manager) as client:
        run_id = finished_run(client, tiny_dir)
        replay = manager.get(client.post(f"/api/library/{run_id}/open", json={}).json()["run_id"])
        copy, state, worker = weakref.ref(replay.trace_copy), weakref.ref(replay.state), replay.worker.thread
        closing = f"/api/runs/{replay.run_id}"
        gc.disable()  # only reference counts may free them
        try:
            del replay
            assert client.delete(closing).status_code == 204
            worker.join(timeout=60)
            assert copy() is None and state() is None
        finally:
            gc.enable()


def test_replays_past_their_memory_limit_are_refused_naming_it_before_the_trace_is_read(tiny_dir, folder):
    first = served(tiny_dir, folder)
    with in_process(first) as client:
        a, b = finished_run(client, tiny_dir), finished_run(client, tiny_dir, {"engine.block_size": 8})
        size = max(client.get(f"/api/library/{i}").json()["trace_bytes"] for i in (a, b))
    room = (copy_bytes(size) + 3 * state_bytes(size)) / MB  # one copy and its replays, not two copies
    manager = RunManager(default_model=tiny_dir, library=RunLibrary(folder),
                         limits=ServiceLimits(max_replay_memory_mb=room))
    with in_process(manager) as client:
        held = client.post(f"/api/library/{a}/open", json={})
        assert held.status_code == 201
        assert client.post(f"/api/library/{a}/open", json={}).status_code == 201  # shares the copy: room enough
        busy = client.post(f"/api/library/{b}/open", json={})
        assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"
        assert "--max-replay-memory-mb" in busy.json()["error"]
        done = client.post(f"/api/library/{a}/open", json={"speed": 0, "paused": False}).json()["run_id"]
        wait_for(lambda: client.get(f"/api/runs/{done}").json()["finished"])
        for run in client.get("/api/runs").json():
            if run["kind"] == "replay" and run["run_id"] != done:
                client.delete(f"/api/runs/{run['run_id']}")
        assert client.post(f"/api/library/{b}/open", json={}).status_code == 201  # the finished replay made room
    tiny = RunManager(default_model=tiny_dir, library=RunLibrary(folder),
                      limits=ServiceLimits(max_replay_memory_mb=copy_bytes(size) / MB / 2))
    with in_process(tiny) as client:
        never = client.post(f"/api/library/{a}/open", json={})
        assert never.status_code == 400 and never.json()["field"] == "trace"


def as_lists(rows: dict[str, deque]) -> dict[str, list]:
    return {k: list(v) for k, v in rows.items()}


def test_a_failed_run_is_saved_marked_failed(tiny_dir, folder):
    manager = served(tiny_dir, folder)
    with in_process(manager) as client:
        run_id = client.post("/api/runs", json={"scenario": scenario(tiny_dir), "paused": True}).json()["run_id"]
        manager.get(run_id).fail("the lecturer pulled the plug")
        wait_for(lambda: client.get("/api/library").json()["entries"])
        [entry] = client.get("/api/library").json()["entries"]
        assert entry["id"] == run_id and entry["failed"] and "pulled the plug" in entry["failure"]


def test_the_entry_model_refuses_paths_as_trace_names():
    with pytest.raises(ValueError):
        Entry(**facts("a1"), created=0, trace="../a1.jsonl", trace_bytes=1)


def test_serve_flags_choose_the_folder_or_none(tmp_path, monkeypatch):
    import argparse

    from kvscope.cli import _library

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    flags = {"no_library": False, "library": None, "library_max_mb": None}
    assert _library(argparse.Namespace(**flags)).folder == tmp_path / "data" / "kvscope" / "library"
    chosen = _library(argparse.Namespace(**{**flags, "library": str(tmp_path / "mine"), "library_max_mb": 5.0}))
    assert chosen.folder == tmp_path / "mine" and chosen.max_bytes == 5 * MB
    assert _library(argparse.Namespace(**{**flags, "no_library": True})) is None


# ---- compare pairs --------------------------------------------------------------------------------------


def header_trace(run_id: str, **engine) -> str:
    """fake_trace with a header a reducer reads: the scenario, the engine's config, the model."""
    header = {"type": "header", "seq": 0, "step": -1, "t": 0.0, "run_id": run_id, "schema_version": 1,
              "scenario": {"name": "shared-prefix"}, "config": {"block_size": 16, "num_blocks": 64, **engine},
              "model": {"name": "demo"}, "cache": {"num_blocks": 64, "block_size": 16, "bytes_per_block": 1}}
    return json.dumps(header) + "\n" + fake_trace(run_id).split("\n", 1)[1]


def test_a_pair_names_its_two_entries_by_what_differs_and_goes_with_either(tmp_path, ticking):
    library = RunLibrary(tmp_path)
    library.save(header_trace("a1", block_size=8, num_blocks=128), **facts("a1"))
    library.save(header_trace("b2", block_size=32, num_blocks=32), **facts("b2"))
    library.save(fake_trace("c3"), **facts("c3"))  # no header a reducer reads: named by the runs' names
    pair = library.save_pair(("a1", "b2"))
    assert pair.runs == ("a1", "b2")
    assert pair.name == "shared-prefix: block_size=8, num_blocks=128 vs block_size=32, num_blocks=32"
    named = library.save_pair(("c3", "a1"), "Week 3: blocks")
    unnamed = library.save_pair(("a1", "c3"))
    assert unnamed.name == "shared-prefix vs shared-prefix"
    assert RunLibrary(tmp_path).pairs() == [unnamed, named, pair]  # a restart lists them, newest first
    library.delete("b2")  # a pair shows both runs or nothing
    assert library.pairs() == [unnamed, named] and not (tmp_path / "pairs" / f"{pair.id}.json").exists()
    library.delete_pair(named.id)
    assert library.pairs() == [unnamed] and [e.id for e in library.entries()] == ["c3", "a1"]  # the runs stay
    with pytest.raises(LibraryError) as e:
        library.save_pair(("a1", "zz9"))
    assert e.value.field == "runs" and "is not a saved run" in str(e.value)
    with pytest.raises(LibraryError) as e:
        library.get_pair(named.id)
    assert e.value.missing


def test_at_most_max_pairs_are_kept_the_oldest_going_first(tmp_path, ticking, monkeypatch):
    monkeypatch.setattr(library_module, "MAX_PAIRS", 2)
    library = RunLibrary(tmp_path)
    for rid in ("a1", "b2"):
        library.save(fake_trace(rid), **facts(rid))
    made = [library.save_pair(("a1", "b2"), f"pair {i}") for i in range(3)]
    assert [p.name for p in library.pairs()] == ["pair 2", "pair 1"] and made[0] not in library.pairs()


def test_a_compare_pair_saved_on_one_server_reopens_side_by_side_on_the_next(tiny_dir, folder):
    first = served(tiny_dir, folder)
    with in_process(first) as client:
        a, b = finished_run(client, tiny_dir), finished_run(client, tiny_dir, {"engine.block_size": 8})
        replay = client.post(f"/api/library/{a}/open", json={}).json()["run_id"]
        saved = client.post("/api/library/pairs", json={"runs": [replay, b]})  # a replay stands for its saved run
        assert saved.status_code == 201 and saved.json()["runs"] == [a, b], saved.json()
        paused = client.post("/api/runs", json={"scenario": scenario(tiny_dir), "paused": True}).json()["run_id"]
        refused = client.post("/api/library/pairs", json={"runs": [a, paused]})
        assert refused.status_code == 400 and refused.json()["field"] == "runs"
        assert "saved when it finishes" in refused.json()["error"]
    second = served(tiny_dir, folder)
    with in_process(second) as client:
        [pair] = client.get("/api/library").json()["pairs"]
        assert pair["id"] == saved.json()["id"] and pair["runs"] == [a, b]
        opened = client.post(f"/api/library/pairs/{pair['id']}/open", json={})
        assert opened.status_code == 201
        left, right = opened.json()["run_ids"]
        assert [second.get(r).kind for r in (left, right)] == ["replay", "replay"]
        assert (second.opened_from[second.get(left)], second.opened_from[second.get(right)]) == (a, b)
        for replay_id, entry_id in ((left, a), (right, b)):  # each replays its run's saved trace
            assert parse_trace(second.get(replay_id).trace_jsonl()) == parse_trace(second.saved().trace_text(entry_id))
        assert client.post("/api/library/pairs/feedfeedfeed/open", json={}).status_code == 404
        assert client.delete(f"/api/library/pairs/{pair['id']}").status_code == 204
        listed = client.get("/api/library").json()
        assert listed["pairs"] == [] and {e["id"] for e in listed["entries"]} >= {a, b}


# ---- exact sampling after a restart ---------------------------------------------------------------------


def test_a_reopened_runs_what_if_equals_the_live_runs_for_its_recorded_tokens(tiny_dir, folder):
    """The other bar was 83% live and 96% reopened (#38): a saved trace had only the top tokens. The tokens a
    run records whole (each sequence's first) are exact after a restart, to the live numbers."""
    import numpy as np

    from kvscope.frontend.sampling_math import Knobs, compute_stages, decode_row, recorded_row
    from kvscope.frontend.views.sampling import exactness_text

    first = served(tiny_dir, folder)
    with in_process(first) as client:
        run_id = finished_run(client, tiny_dir)
        vocab = client.get(f"/api/runs/{run_id}").json()["model"]["vocab_size"]
        tokens = [e for e in parse_trace(client.get(f"/api/runs/{run_id}/trace").text) if e["type"] == "token"]
        live = {(t["request_id"], t["position"]): decode_row(client.get(
            f"/api/runs/{run_id}/dist", params={"request_id": t["request_id"], "seq_id": t["seq_id"],
                                                 "position": t["position"]}).json()["raw_probs_f32"]) for t in tokens}
    second = served(tiny_dir, folder)
    with in_process(second) as client:
        replay_id = client.post(f"/api/library/{run_id}/open", json={}).json()["run_id"]
        reopened = [e for e in parse_trace(client.get(f"/api/runs/{replay_id}/trace").text) if e["type"] == "token"]
    recorded = [t for t in reopened if recorded_row(t["dist"]) is not None]
    assert {t["request_id"] for t in recorded} == {f"r{i}" for i in range(4)}  # each request's first token
    for token in recorded:
        for knobs in (Knobs(1.9), Knobs(0.7, 5, 0.8, 0.05), Knobs(1.3, 0, 0.9, 0.0)):
            theirs = compute_stages(token["dist"]["top"], knobs, {0}, vocab, live[token["request_id"], token["position"]])
            mine = compute_stages(token["dist"]["top"], knobs, {0}, vocab, recorded_row(token["dist"]))
            for stage in theirs.probs:
                assert np.allclose(mine.probs[stage], theirs.probs[stage], atol=1e-6, rtol=0)
                assert mine.tail[stage] == pytest.approx(theirs.tail[stage], abs=1e-6)
            assert exactness_text(mine, 10, False, False).startswith("exact")
