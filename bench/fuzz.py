"""Fuzzing a live server: hostile values for every field of every route, and the invariants after each.

    python -m bench.fuzz [--cases 3000] [--class-cases 12] [--store-cases 12] [--seconds 1800] [--seed 0]
                         [--rss-growth-mb 1200]

Starts `kvscope serve --no-ui` on the demo model on a free loopback port, with small limits
(KV 512 MB, 256 MB a run, weights 512 MB, 8 runs, grammars 2 s and 64 MB a run, replays 1 GB) and a run
library holding one large saved run, and sends hypothesis-drawn cases (bench/fuzz_cases.py): /v1
completions and chat, a run's requests and controls, runs started from scenario objects, inline YAML,
overrides and broken replay traces, GET routes with odd ids and queries, and websockets fed junk
frames; then --class-cases of each hostile class #35 found: grammars that strand a row (on every route
that takes one, streamed or not), huge grammars, nested tool-call histories, lone surrogates in nested
strings, and repeated opens of the large saved run; and, as a class of its own (`--store-cases`,
bench/fuzz_store.py), tensor-parallel runs with a hostile client of their rendezvous store. After every
case it checks what must hold whatever a client sends:
- the answer is not a 5xx (a websocket is not closed with 1011) and the server process lives;
- no other request was failed by this case: for the /v1 bodies, a run's requests and every hostile
  class, a normal completion streams while the case is sent and must finish as if alone;
- the `api` run answers a normal completion with 200, and once idle holds no block (every KV block
  back in the free list, the prefix cache's among them);
- no run has failed (a failure means a worker raised: an input got past its bounds);
- the server's resident memory stays within --rss-growth-mb of where it started, and after a case whose
  runs are closed again (the saved run's opens) within 100 MB of where it was before that case.
A store case checks its class's own invariants besides (no code ran in a rank, the run failed cleanly
or finished, its ranks gone within seconds, RSS back within 100 MB once it is forgotten: fuzz_store.py).
Prints a table of cases per route, the answers seen and every finding (the case that broke which
invariant); exits 1 on any. The test suite runs a short one (tests/test_fuzz_live.py: CI_CASES route
cases and one store case).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from bench.fuzz_cases import (COMPLETION, ISSUE_ATTACK, SCENARIO, Case, Targets, hostile_classes,
                               hostile_store_cases, repeated_trace, routes)
from bench.fuzz_store import hostile_store_case
from bench.report import command_line, progress, table
from bench.soak import launch, rss_mb
from kvscope.backend.server.library import RunLibrary, run_facts
from kvscope.backend.server.serve import free_port

LIMITS = ["--max-kv-memory-mb", "512", "--max-run-kv-memory-mb", "256", "--max-weight-memory-mb", "512",
          "--max-runs", "8", "--paused-ttl-s", "20", "--request-timeout-s", "60", "--stall-timeout-s", "60",
          # a legitimate grammar compiles in milliseconds on the demo model; 13,000 classes took ~4 s
          "--grammar-timeout-s", "2", "--max-grammar-compiles", "2", "--grammar-cache-mb", "64",
          "--max-replay-memory-mb", "1024"]
# The check between cases: a prompt of several blocks, so the prefix cache keeps some once it is done.
NORMAL = {**COMPLETION, "prompt": "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and "
                                  "Juliet is the sun.", "max_tokens": 4}
CASE_TIMEOUT_S = 90  # one case's answer; a longer one is a finding (the server's own bound is 60 s)
IDLE_TIMEOUT_S = 60  # for the api run to drain after a case
BESIDE = {**COMPLETION, "max_tokens": 8, "ignore_eos": True, "stream": True}  # streams while a case is sent
RSS_COMEBACK_MB = 100  # a case's runs closed, the server's RSS is back within this of where it was before
SAVED_ID = "fuzz-large"  # the large saved run the library cases open


class Beside:
    """A normal streamed completion, running (its first chunk read) before the case is sent; `problem` says
    how the case failed it (None: it streamed all its tokens and finished by length, as if alone)."""

    def __init__(self, base_url: str) -> None:
        self.chunks: list[str] = []
        self.error: str | None = None
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._stream, args=(base_url,), daemon=True)
        self.thread.start()
        self.started.wait(CASE_TIMEOUT_S)

    def _stream(self, base_url: str) -> None:
        try:
            with httpx.Client(base_url=base_url, timeout=CASE_TIMEOUT_S) as client, \
                    client.stream("POST", "/v1/completions", json=BESIDE) as answer:
                if answer.status_code != 200:
                    self.error = f"the request beside it got {answer.status_code}"
                for line in answer.iter_lines():
                    if line.startswith("data: "):
                        self.chunks.append(line[len("data: "):])
                        self.started.set()
        except httpx.HTTPError as e:
            self.error = f"the request beside it broke ({type(e).__name__})"
        finally:
            self.started.set()

    def problem(self) -> str | None:
        self.thread.join(CASE_TIMEOUT_S)
        if self.error or self.thread.is_alive():
            return self.error or "the request beside it did not finish"
        finishes = [c.get("finish_reason") for chunk in self.chunks[:-1] for c in json.loads(chunk).get("choices", [])]
        tokens = sum(1 for chunk in self.chunks[:-1] for c in json.loads(chunk).get("choices", []) if c.get("text"))
        if self.chunks[-1:] != ["[DONE]"] or [f for f in finishes if f] != ["length"]:
            return f"the request beside it ended {[f for f in finishes if f]} / {self.chunks[-2:]}"
        return None if tokens >= 1 else "the request beside it streamed no text"


@dataclass
class Tally:
    """What the run saw: cases and answers per route, and each finding (case, broken invariant)."""
    routes: Counter = field(default_factory=Counter)
    answers: dict[str, Counter] = field(default_factory=dict)
    findings: list[str] = field(default_factory=list)
    planned: int = 0  # the cases the plan drew (each route family max_cases // families, each class its own)

    def count(self, case: Case, answer: str) -> None:
        route = route_of(case)
        self.routes[route] += 1
        self.answers.setdefault(route, Counter())[answer] += 1


def route_of(case: Case) -> str:
    if case.family:
        return case.family
    if case.method == "WS":
        return "WS /ws/runs/{run}"
    if case.method == "STORE":
        return "STORE of a TP run (hostile client)"
    if case.method == "GET":
        return "GET " + case.path.split("?")[0].split("/")[1]
    for known in ("/control", "/requests"):
        if case.path.endswith(known):
            return "POST /api/runs/{run}" + known
    if case.path == "/api/runs":
        return "POST /api/runs (" + case.label.split(":")[0].split(" ")[0] + ")"
    return "POST " + case.path


class Harness:
    """A live server, the runs the cases aim at, and the invariant checks."""

    def __init__(self, rss_growth_mb: float, saved_mb: float = 8) -> None:
        self.port = free_port()
        self.library = tempfile.mkdtemp(prefix="kvscope-fuzz-library-")
        self.saved_mb = saved_mb  # the size of the large saved run's trace
        self.proc = launch(["--port", str(self.port), "--model", "demo", "--library", self.library, *LIMITS])
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=CASE_TIMEOUT_S)
        self.run_ids: dict[str, str] = {}
        self.trace_lines: list[str] = []  # a recorded trace, replayed by the {replay} run
        self.assert_normal_request()
        self.free_at_start = self.free_blocks(self.api_snapshot())
        self.rss_bound = rss_mb(self.proc.pid) + rss_growth_mb

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(timeout=60)
        shutil.rmtree(self.library, ignore_errors=True)

    # ---- the runs the cases aim at ------------------------------------------------------------

    def targets(self) -> Targets:
        openapi = self.client.get("/schema/openapi.json").json()
        props = {name: sorted(s.get("properties", {})) for name, s in openapi["components"]["schemas"].items()}
        paths = openapi["paths"]
        gets = [p.replace("{run_id}", "{run}").replace("{model_id}", "{model}") for p, item in paths.items()
                if "get" in item]
        self.trace_lines = self.recorded_trace()
        self.save_large_run()
        return Targets(props["CompletionBody"], props["ChatBody"], props["AddRequest"], props["StartRun"],
                       gets, self.trace_lines)

    def recorded_trace(self) -> list[str]:
        """A small scenario's whole trace, run unpaced to its end: the replay cases break it line by line."""
        run_id = self.start({"scenario": SCENARIO, "speed": 0})
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while not self.client.get(f"/api/runs/{run_id}").json()["finished"]:
            if time.monotonic() > deadline:
                raise RuntimeError("the fuzz scenario did not finish")
            time.sleep(0.1)
        return self.client.get(f"/api/runs/{run_id}/trace").text.splitlines()

    def save_large_run(self) -> None:
        """The recorded trace repeated to saved_mb, saved in the server's library folder (it lists the folder
        as it is asked: the entry appears without a restart)."""
        text = repeated_trace(self.trace_lines, int(self.saved_mb * 2**20))
        facts = run_facts(SAVED_ID, {"name": "fuzz-large"}, {"name": "demo"}, {}, False, 0, 0, None)
        RunLibrary(self.library).save(text, **facts)

    def start(self, body: dict) -> str:
        answer = self.client.post("/api/runs", json=body)
        answer.raise_for_status()
        return answer.json()["run_id"]

    def run_id(self, kind: str) -> str:
        """A live paused run of this kind ("scenario" or "replay"), started again once forgotten."""
        known = self.run_ids.get(kind)
        if known and self.client.get(f"/api/runs/{known}").status_code == 200:
            return known
        body = {"scenario": SCENARIO, "paused": True} if kind == "scenario" else \
            {"trace": "\n".join(self.trace_lines) + "\n", "paused": True}
        answer = self.client.post("/api/runs", json=body)
        self.run_ids[kind] = answer.json()["run_id"] if answer.status_code == 201 else "nope"
        return self.run_ids[kind]

    def resolve(self, path: str) -> str:
        path = path.replace("{saved}", SAVED_ID)
        for kind in ("scenario", "replay"):
            if "{" + kind + "}" in path:
                path = path.replace("{" + kind + "}", self.run_id(kind))
        return path

    # ---- one case and the invariants after it -------------------------------------------------

    def send(self, case: Case) -> str:
        """The case's answer as a status ("200", "4xx: 422", ...) or "broke: ..." for a finding: a 5xx, or
        the request streaming beside it failed, or the memory its closed runs held did not come back."""
        if case.method == "STORE":
            return hostile_store_case(self.client, self.proc.pid, case.body or "{}")
        before = rss_mb(self.proc.pid) if case.closes else 0.0
        beside = Beside(str(self.client.base_url)) if case.beside else None
        answers = [self.send_once(case) for _ in range(case.repeat)]
        statuses = [status for status, _ in answers]
        problem = beside.problem() if beside is not None else None
        broken = next((s for s in statuses if s.startswith("broke")), None)
        if broken or problem:
            return broken or f"broke: {problem}"
        if case.closes:
            started = [run for _, run in answers if run]
            for run in started:
                self.client.delete(f"/api/runs/{run}")
            rss = self.rss_back_to(before + RSS_COMEBACK_MB)
            if rss > before + RSS_COMEBACK_MB:
                return (f"broke: RSS {rss:.0f} MB once its {len(started)} runs were closed, more than "
                        f"{RSS_COMEBACK_MB} MB past the {before:.0f} MB before it")
        if case.path == "/api/runs/api/control":  # paused or slowed: the next cases' requests would wait on it
            self.client.post("/api/runs/api/control", json={"action": "resume"})
            self.client.post("/api/runs/api/control", json={"action": "speed", "value": 0})
        return statuses[-1]

    def rss_back_to(self, bound: float, within_s: float = 10) -> float:
        """The server's RSS once it is within `bound`, or after within_s: a closed run's worker lets go of it
        as the thread ends, just after the close returns."""
        deadline = time.monotonic() + within_s
        while (rss := rss_mb(self.proc.pid)) > bound and time.monotonic() < deadline:
            time.sleep(0.1)
        return rss

    def send_once(self, case: Case) -> tuple[str, str | None]:
        """(status, the run id a 201 started or None)."""
        path = self.resolve(case.path)
        try:
            if case.method == "WS":
                return self.websocket(path, case.body or ""), None
            if case.method == "GET":
                answer = self.client.get(path)
            else:
                answer = self.client.post(path, content=(case.body or "").encode("utf-8", "surrogatepass"),
                                          headers={"content-type": "application/json"})
        except httpx.TransportError as e:
            return f"broke: no answer ({type(e).__name__})", None
        status = answer.status_code
        run = answer.json().get("run_id") if status == 201 and "json" in answer.headers.get("content-type", "") \
            else None
        return (f"broke: {status}" if status >= 500 else str(status)), run

    def websocket(self, path: str, frames: str) -> str:
        try:
            with connect(f"ws://127.0.0.1:{self.port}{path}", open_timeout=30, close_timeout=5,
                         max_size=None) as socket:
                for frame in filter(None, frames.split("\n")):
                    socket.send(frame)
                socket.recv(timeout=5)
        except TimeoutError:
            return "open"
        except InvalidStatus as e:
            status = e.response.status_code
            return f"broke: {status}" if status >= 500 else str(status)
        except ConnectionClosed as e:
            code = e.rcvd.code if e.rcvd else None
            return "broke: closed 1011" if code == 1011 else f"closed {code}"
        return "open"

    def invariants(self) -> str | None:
        """The first invariant that does not hold, or None."""
        if self.proc.poll() is not None:
            return f"the server exited ({self.proc.returncode})"
        failed = [r["run_id"] for r in self.client.get("/api/runs").json() if r["failed"]]
        if failed:
            error = self.client.get(f"/api/runs/{failed[0]}").json().get("error")
            return f"run {failed[0]} failed: {error}"
        try:
            self.assert_normal_request()
            snapshot = self.idle_api_snapshot()
        except (AssertionError, httpx.TransportError) as e:
            return f"the api run: {e}"
        if snapshot["block_tables"] or self.free_blocks(snapshot) != self.free_at_start:
            return (f"the idle api run holds blocks: {len(snapshot['block_tables'])} tables, "
                    f"{self.free_blocks(snapshot)} of {self.free_at_start} free")
        rss = rss_mb(self.proc.pid)
        if rss > self.rss_bound:
            return f"RSS {rss:.0f} MB, past the bound of {self.rss_bound:.0f} MB"
        return None

    def assert_normal_request(self) -> None:
        answer = self.client.post("/v1/completions", json=NORMAL)
        assert answer.status_code == 200 and answer.json()["choices"], f"a normal request got {answer.status_code}"

    def api_snapshot(self) -> dict:
        return self.client.get("/api/runs/api").json()

    def idle_api_snapshot(self) -> dict:
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while (snapshot := self.api_snapshot())["running"] or snapshot["waiting"]:
            assert time.monotonic() < deadline, f"still busy after {IDLE_TIMEOUT_S} s"
            time.sleep(0.05)
        return snapshot

    @staticmethod
    def free_blocks(snapshot: dict) -> int:
        return len(snapshot["free_blocks"])  # the prefix cache's blocks are free blocks too (a subset)


def fuzz(max_cases: int, seconds: float, seed: int, rss_growth_mb: float = 1200, class_cases: int = 12,
         saved_mb: float = 8, store_cases: int = 0) -> Tally:
    """Up to max_cases cases over the routes, class_cases of each hostile class and store_cases store cases
    within seconds (the case under way finishes), every invariant after each. saved_mb: the large saved
    run's trace."""
    started = time.monotonic()
    harness = Harness(rss_growth_mb, saved_mb)
    tally = Tally()
    try:
        families = routes(harness.targets())
        plan = [(family, max(1, max_cases // len(families))) for family in families]
        plan += [(hostile, class_cases) for hostile in hostile_classes()] if class_cases else []
        if store_cases:  # each spawns ranks, so counted apart; the issue's own attack first, whatever is drawn
            fuzz_case(harness, tally, ISSUE_ATTACK)
            plan += [(hostile_store_cases(), store_cases - 1)] if store_cases > 1 else []
        tally.planned = sum(cases for _, cases in plan) + bool(store_cases)
        for i, (family, cases) in enumerate(plan):  # each family its share of cases and of the time
            family_deadline = time.monotonic() + (seconds - (time.monotonic() - started)) / (len(plan) - i)
            fuzz_family(harness, tally, family, cases, family_deadline, seed)
    finally:
        harness.close()
    return tally


def fuzz_family(harness: Harness, tally: Tally, family: st.SearchStrategy[Case], max_cases: int,
                deadline: float, seed: int) -> None:
    @hypothesis_seed(seed)
    @settings(max_examples=max_cases, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=family)
    def one(case: Case) -> None:
        if time.monotonic() > deadline or harness.proc.poll() is not None:
            return
        fuzz_case(harness, tally, case)

    one()


def fuzz_case(harness: Harness, tally: Tally, case: Case) -> None:
    """Send one case, count its answer, and record what it broke: its own answer, or an invariant after it."""
    answer = harness.send(case)
    tally.count(case, answer.split(":")[0] if answer.startswith("broke") else answer)
    broken = answer[len("broke: "):] if answer.startswith("broke") else harness.invariants()
    if broken:
        tally.findings.append(f"{case.describe()} -> {broken}")
        progress(f"finding: {tally.findings[-1][:400]}")


def report(tally: Tally) -> str:
    rows = [[route, n, ", ".join(f"{a} x{c}" for a, c in sorted(tally.answers[route].items()))]
            for route, n in sorted(tally.routes.items())]
    rows.append(["all routes", sum(tally.routes.values()), f"{len(tally.findings)} findings"])
    text = table(["route", "cases", "answers"], rows)
    return text + "".join(f"\n- {f[:1000]}" for f in tally.findings)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=3000, help="at most this many cases")
    p.add_argument("--store-cases", type=int, default=12,
                   help="cases of the class 'TP runs with a hostile store client' (each starts a TP=2 run)")
    p.add_argument("--seconds", type=float, default=1800, help="stop drawing cases after this long")
    p.add_argument("--seed", type=int, default=0, help="hypothesis's seed: another seed, other cases")
    p.add_argument("--rss-growth-mb", type=float, default=1200, help="the server's RSS may grow this much")
    p.add_argument("--class-cases", type=int, default=12, help="cases of each hostile class (#35's); 0: none")
    p.add_argument("--saved-mb", type=float, default=32, help="the large saved run's trace, opened again and again")
    args = p.parse_args(argv)
    tally = fuzz(args.cases, args.seconds, args.seed, args.rss_growth_mb, args.class_cases, args.saved_mb,
                 args.store_cases)
    print(command_line("bench.fuzz", argv if argv is not None else sys.argv[1:]))
    print()
    print(report(tally))
    sys.exit(1 if tally.findings else 0)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
