"""No test asserts a wall-clock bound: CI runs on a shared machine, where one loaded minute fails it.

Speed belongs in bench/ (printed with its target); a test asserts engine time (steps, the engine's
own durations) and event order, and waits on conditions with a generous deadline. The check parses
every test module (no code runs) and finds ordering comparisons (<, <=, >, >=) inside `assert` that
involve a wall-clock reading: a call of time.monotonic/perf_counter/time/process_time, or a name
computed from one in the same function, or a name that says it is a latency (p95, elapsed, ...).
A deadline guard (`assert time.monotonic() < deadline`) is a wait with a limit, not a measurement, and
`assert measured_ms > 0` only says that a figure exists.

Nor does a test sleep and then assert: "sleep 0.3 s, then the run is still at step 2" passes on a
loaded machine whether or not the run would have stepped, and "sleep 1 s, then 4 to 13 steps ran" is a
wall-clock bound in disguise. A test waits on a state instead (tests/server_helpers.py: `wait_for`,
`until`, and `settled_snapshot` for "nothing more happened"). The second check finds a sleep statement
(`time.sleep`, `asyncio.sleep`, Playwright's `wait_for_timeout`) followed by an assertion before any
wait: later in its block, or after the `with`, `if` or `try` around it, an `assert` or a call of a function
of the module that asserts. A wait (a call named wait..., ...until..., ...when, settled..., eventually)
between them makes the assertion one about a state. Not counted: a deadline guard (`assert
time.monotonic() < deadline`), and whatever follows a loop, for a sleep in a loop's body is a polling
loop's pause, and the assertion after the loop is on the state it waited for.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CLOCKS = {"monotonic", "perf_counter", "time", "process_time", "monotonic_ns", "perf_counter_ns", "time_ns"}
ORDERING = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
LATENCY_WORDS = re.compile(r"p9[059]|latency|elapsed|wall|click|steps_per_s|rate_s|_ms$", re.IGNORECASE)


def is_clock_call(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CLOCKS
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "time")


def names_in(node: ast.AST) -> set[str]:
    found = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    found |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
    found |= {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return found


def clock_functions(tree: ast.Module) -> set[str]:
    """Functions of the module that return a wall-clock measurement (a helper that times something)."""
    out = set()
    for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        tainted = tainted_names(fn, set())
        for ret in (n for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None):
            if any(is_clock_call(n) for n in ast.walk(ret.value)) or names_in(ret.value) & tainted:
                out.add(fn.name)
    return out


def tainted_names(fn: ast.AST, clocked: set[str]) -> set[str]:
    """Names in fn assigned (or appended to) from a clock reading, directly or through other such names."""
    def reads_clock(value: ast.AST, tainted: set[str]) -> bool:
        return any(is_clock_call(n) or isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                   and n.func.id in clocked for n in ast.walk(value)) or bool(names_in(value) & tainted)

    tainted: set[str] = set()
    while True:
        before = len(tainted)
        for node in ast.walk(fn):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if reads_clock(node.value, tainted):
                    tainted |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append"
                  and isinstance(node.func.value, ast.Name) and any(reads_clock(a, tainted) for a in node.args)):
                tainted.add(node.func.value.id)
        if len(tainted) == before:
            return tainted


def is_allowed(compare: ast.Compare) -> bool:
    """A deadline guard, or `measured > 0`: a figure exists (a benchmark's smoke test), bounding nothing."""
    sides = [compare.left, *compare.comparators]
    positive = len(compare.ops) == 1 and isinstance(compare.ops[0], ast.Gt) and \
        isinstance(compare.comparators[0], ast.Constant) and compare.comparators[0].value == 0
    return positive or any(isinstance(side, ast.Name) and "deadline" in side.id for side in sides)


def timed_assertions(source: str, filename: str) -> list[str]:
    tree = ast.parse(source)
    clocked = clock_functions(tree)
    found = []
    for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        tainted = tainted_names(fn, clocked)
        for test in (n.test for n in ast.walk(fn) if isinstance(n, ast.Assert)):
            for cmp in (n for n in ast.walk(test) if isinstance(n, ast.Compare)):
                if not any(isinstance(op, ORDERING) for op in cmp.ops) or is_allowed(cmp):
                    continue
                names = names_in(cmp)
                clock = any(is_clock_call(n) or isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                            and n.func.id in clocked for n in ast.walk(cmp))
                if clock or names & tainted or any(LATENCY_WORDS.search(n) for n in names):
                    found.append(f"{filename}:{cmp.lineno}: {ast.unparse(cmp)}")
    return found


SLEEPS = {"sleep", "wait_for_timeout"}
WAITS = re.compile(r"(^|_)(wait|until|when|settled|eventually)($|_)")
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
LOOPS = (ast.For, ast.AsyncFor, ast.While)


def call_name(call: ast.Call) -> str | None:
    return call.func.id if isinstance(call.func, ast.Name) else \
        call.func.attr if isinstance(call.func, ast.Attribute) else None


def is_sleep(stmt: ast.stmt) -> bool:
    value = stmt.value if isinstance(stmt, ast.Expr) else None
    value = value.value if isinstance(value, ast.Await) else value
    return isinstance(value, ast.Call) and call_name(value) in SLEEPS


def is_wait(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and call_name(node) not in SLEEPS and bool(WAITS.search(call_name(node) or ""))


def is_deadline_guard(node: ast.Assert) -> bool:
    return any(is_clock_call(n) or isinstance(n, ast.Name) and "deadline" in n.id for n in ast.walk(node.test))


def inside(node: ast.AST):
    """node and what it holds, in source order, without entering functions, classes or lambdas defined there."""
    yield node
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, SCOPES):
            yield from inside(child)


def asserting_functions(tree: ast.Module) -> set[str]:
    """The module's functions that assert, directly or through another of them (a wait is not one)."""
    functions = {fn.name: fn for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and not WAITS.search(fn.name)}
    found: set[str] = set()
    while True:
        more = {name for name, fn in functions.items() if name not in found and any(
            isinstance(n, ast.Assert) and not is_deadline_guard(n) or isinstance(n, ast.Call) and call_name(n) in found
            for stmt in fn.body for n in inside(stmt))}
        if not more:
            return found
        found |= more


def first_check(statements: list[ast.stmt], asserting: set[str]) -> ast.AST | None:
    """The first assertion in statements run in order, or None when a wait (or nothing) comes first."""
    for stmt in statements:
        for node in inside(stmt):
            if is_wait(node) or isinstance(node, ast.Assert) and any(is_wait(n) for n in ast.walk(node.test)):
                return None
            if isinstance(node, ast.Assert) and not is_deadline_guard(node) or \
                    isinstance(node, ast.Call) and call_name(node) in asserting:
                return node
    return None


def blocks_of(stmt: ast.stmt):
    """(field, statements) for each block a compound statement holds: its body, else, finally, handlers, cases."""
    for field in ("body", "orelse", "finalbody"):
        if statements := getattr(stmt, field, None):
            yield field, statements
    for part in [*getattr(stmt, "handlers", []), *getattr(stmt, "cases", [])]:
        yield "handler", part.body


def sleeps_then_asserts(source: str, filename: str) -> list[str]:
    """Each sleep statement with the assertion that follows it before any wait (the module docstring's rule)."""
    tree = ast.parse(source)
    asserting = asserting_functions(tree)
    found = []

    def block(statements: list[ast.stmt], following: list[ast.stmt]) -> None:
        for i, stmt in enumerate(statements):
            after = statements[i + 1:] + following
            if is_sleep(stmt) and (check := first_check(after, asserting)) is not None:
                found.append(f"{filename}:{stmt.lineno}: {ast.unparse(stmt)} ... {check.lineno}: "
                             f"{ast.unparse(check).splitlines()[0]}")
            for field, inner in blocks_of(stmt):
                ends_here = isinstance(stmt, SCOPES) or isinstance(stmt, LOOPS) and field == "body"
                block(inner, [] if ends_here else after)

    block(tree.body, [])
    return found


def every_test_module():
    """(source, file name) of every module under tests/ but this one, whose examples are meant to be caught."""
    for path in sorted(TESTS.glob("*.py")):
        if path.name != Path(__file__).name:
            yield path.read_text(encoding="utf-8"), path.name


def test_no_test_asserts_a_wall_clock_bound():
    assert [hit for module in every_test_module() for hit in timed_assertions(*module)] == []


def test_the_check_finds_each_kind_of_timed_assertion_and_lets_deadline_guards_be():
    source = '''
import time

def measure():
    began = time.perf_counter()
    return time.perf_counter() - began

def test_direct():
    started = time.monotonic()
    do()
    assert time.monotonic() - started < 5

def test_through_names():
    clicks = []
    began = time.monotonic()
    clicks.append(time.monotonic() - began)
    worst = max(clicks)
    assert worst < 2.0

def test_helper_and_words(result):
    assert measure() < 1.0
    assert result["p95"] < LATENCY_P95_MS

def test_allowed(deadline):
    while not ready():
        assert time.monotonic() < deadline, "timed out"
    assert steps_low < steps_high and len(events) > 20 and result["decode_ms"] > 0
'''
    assert [hit.split(": ", 1)[1] for hit in timed_assertions(source, "t.py")] == [
        "time.monotonic() - started < 5", "worst < 2.0", "measure() < 1.0", "result['p95'] < LATENCY_P95_MS"]


def test_no_test_sleeps_and_then_asserts():
    assert [hit for module in every_test_module() for hit in sleeps_then_asserts(*module)] == []


def test_the_sleep_check_finds_each_way_of_sleeping_then_asserting_and_lets_waits_and_polling_loops_be():
    source = '''
import asyncio, time

def check_the_moment(page):
    assert page.outlined

async def test_caught(client, page, feed, ws):
    time.sleep(0.3)
    assert client.get("/api/runs/r").json()["step"] == 2
    time.sleep(1.0)
    step = client.get("/api/runs/r").json()["step"]
    assert 4 <= step <= 13
    for _ in range(3):
        time.sleep(0.2)
        assert client.get("/api/runs/r").json()["step"] == 7
    await asyncio.sleep(0.5)
    assert feed.state.step == 0
    page.wait_for_timeout(1500)
    assert page.ringed == "3 4"
    with ws:
        time.sleep(3)
    assert "snapshot" in seen
    time.sleep(1.0)
    for chart in charts:
        assert chart.laid_out
    while moments:
        time.sleep(0.3)
        check_the_moment(page)

async def test_allowed(client, page, feed, deadline):
    while not ready():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    while not ready():
        time.sleep(0.02)
        assert time.monotonic() < deadline, "timed out"
    for _ in range(100):
        await asyncio.sleep(0.05)
        if ready():
            break
    assert ready()
    time.sleep(0.3)
    wait_for(lambda: client.get("/api/runs/r").json()["finished"])
    assert client.get("/api/runs/r").json()["finished"]
    await asyncio.sleep(0.1)
    await until(lambda: feed.state.step == 0)
    assert feed.state.step == 0
    page.wait_for_timeout(300)
    page.wait_for_function("() => window.kvscope")
    assert page.title
    time.sleep(0.1)
    assert settled_snapshot(client, "r")["step"] == 2

    def slow_step():
        time.sleep(1.0)
        return step()

    assert slow_step()
'''
    hits = [hit.split(": ", 1)[1] for hit in sleeps_then_asserts(source, "t.py")]
    assert hits == [
        "time.sleep(0.3) ... 9: assert client.get('/api/runs/r').json()['step'] == 2",
        "time.sleep(1.0) ... 12: assert 4 <= step <= 13",
        "time.sleep(0.2) ... 15: assert client.get('/api/runs/r').json()['step'] == 7",
        "await asyncio.sleep(0.5) ... 17: assert feed.state.step == 0",
        "page.wait_for_timeout(1500) ... 19: assert page.ringed == '3 4'",
        "time.sleep(3) ... 22: assert 'snapshot' in seen",
        "time.sleep(1.0) ... 25: assert chart.laid_out",
        "time.sleep(0.3) ... 28: check_the_moment(page)",
    ]
