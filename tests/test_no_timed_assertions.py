"""No test asserts a wall-clock bound: CI runs on a shared machine, where one loaded minute fails it.

Speed belongs in bench/ (printed with its target); a test asserts engine time (steps, the engine's
own durations) and event order, and waits on conditions with a generous deadline. The check parses
every test module (no code runs) and finds ordering comparisons (<, <=, >, >=) inside `assert` that
involve a wall-clock reading: a call of time.monotonic/perf_counter/time/process_time, or a name
computed from one in the same function, or a name that says it is a latency (p95, elapsed, ...).
A deadline guard (`assert time.monotonic() < deadline`) is a wait with a limit, not a measurement, and
`assert measured_ms > 0` only says that a figure exists.
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


def test_no_test_asserts_a_wall_clock_bound():
    found = [hit for path in sorted(TESTS.glob("*.py")) if path.name != Path(__file__).name
             for hit in timed_assertions(path.read_text(encoding="utf-8"), path.name)]
    assert found == []


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
