"""One writer of request state (#23): only the scheduler assigns a sequence's tokens, its computed count
or its status. Read from the source, as tests/test_imports.py reads the imports: an assignment, an
augmented assignment, a `del` or a mutating call on one of those fields anywhere else in the engine
fails here, naming the line."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIELDS = {"num_computed_tokens", "num_cached_prompt_tokens", "token_ids", "status"}
WRITER = ROOT / "backend" / "engine" / "scheduler.py"
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "__setitem__", "__delitem__"}


def _field(node: ast.AST) -> str | None:
    """The state field an expression names: `x.token_ids`, or `x.token_ids[...]` (a write into it)."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and node.attr in FIELDS:
        return node.attr
    return None


def writes(source: str) -> list[tuple[int, str]]:
    """(line, field) of every write of a state field in a module's source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            targets = [node.func.value]
        found += [(node.lineno, f) for t in targets if (f := _field(t))]
    return sorted(found)


def engine_modules() -> list[Path]:
    """The engine and what runs it in place of a model (simulate mode). The reducer's and the API's own
    views of a request (backend/events, backend/server) are observers with fields of their own."""
    return sorted((ROOT / "backend" / "engine").glob("*.py")) + sorted((ROOT / "backend" / "perf").glob("*.py"))


def test_only_the_scheduler_writes_request_state() -> None:
    leaks = [f"{path.relative_to(ROOT)}:{line} writes .{field}"
             for path in engine_modules() if path != WRITER
             for line, field in writes(path.read_text())]
    assert not leaks, "only backend/engine/scheduler.py may write a sequence's state:\n" + "\n".join(leaks)


def test_the_scheduler_is_where_the_writes_are() -> None:
    assert {field for _, field in writes(WRITER.read_text())} >= {"num_computed_tokens", "token_ids", "status"}


def test_the_check_sees_every_kind_of_write() -> None:
    source = """
seq.num_computed_tokens = 3
seq.token_ids += [1]
seq.token_ids.append(2)
del seq.token_ids[4:]
a, seq.status = 1, "finished"
seq.token_ids[0] = 5
seq.num_cached_prompt_tokens: int = 0
x = seq.token_ids[:3]
print(seq.status)
"""
    assert [line for line, _ in writes(source)] == [2, 3, 4, 5, 6, 7, 8]
