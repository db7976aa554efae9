"""One writer of request state (#23, #34): the scheduler decides, and only the scheduler writes a request's or
a sequence's fields; only the block manager writes a block table.

A guard, not a fence: read from the source of every product module (backend/, frontend/, kvscope/), as
tests/test_imports.py reads the imports. It fails, naming the line, on an assignment, an augmented
assignment, a `del`, a `setattr` or a mutating call on a state field anywhere but the owner, including
writes through a local alias (`ids = seq.token_ids; ids.append(t)`, `times = req.times; times.finish = t`).
The fields are read from the state classes themselves, so a new field is guarded the day it is added.
A module that defines a class of its own with a field of the same name (the event reducer's request
view has a `finish_reason` too) may write that name on its own objects; the check trusts its classes,
and the list of those exemptions is asserted below so that a new one is a decision, not an accident.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from kvscope.backend.engine.beam_search import BeamState
from kvscope.backend.engine.metrics import RequestTimes
from kvscope.backend.engine.request import Request
from kvscope.backend.engine.sequence import Sequence

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("backend", "frontend", "kvscope")
SCHEDULER = ROOT / "backend" / "engine" / "scheduler.py"
BLOCK_MANAGER = ROOT / "backend" / "engine" / "block_manager.py"
STATE_CLASSES = {cls.__name__: cls for cls in (Sequence, Request, RequestTimes, BeamState)}
STATE = {f.name for cls in STATE_CLASSES.values() for f in dataclasses.fields(cls)}
TABLES = {"block_table", "_tables"}  # a sequence's block table: the block manager's alone
# Fields holding an object a write can reach through a local name (lists, dicts, times, beams, sequences).
MUTABLE = {f.name for cls in STATE_CLASSES.values() for f in dataclasses.fields(cls)
           if not str(f.type).replace(" ", "").removesuffix("|None") in ("int", "str", "float", "bool")}
MUTATORS = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "sort", "reverse", "update",
            "setdefault", "add", "discard", "appendleft", "extendleft", "__setitem__", "__delitem__"}


def _field(node: ast.AST, fields: set[str]) -> str | None:
    """The guarded field an expression names: `x.f` or `x.f[...]` (a write into it)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and node.attr in fields:
        return node.attr
    return None


def _is_self(node: ast.AST) -> bool:
    while isinstance(node, ast.Subscript):
        node = node.value
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


def _targets(node: ast.AST) -> list[ast.AST]:
    """What a statement writes to (tuple targets unpacked)."""
    if isinstance(node, ast.Assign):
        return [t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    if isinstance(node, ast.Delete):
        return node.targets
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
        return [node.func.value]
    return []


def own_fields(tree: ast.AST) -> set[str]:
    """Attribute names the module's own classes declare (class-level annotations, `self.x = ...`)."""
    names = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            for target in _targets(node) if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) else []:
                if isinstance(target, ast.Attribute) and _is_self(target):
                    names.add(target.attr)
    return names


def aliases(scope: ast.AST, fields: set[str]) -> dict[str, str]:
    """Local names bound to the value of a guarded field that holds a mutable object (a list, a dict,
    a request's times): name -> the field. An int or a string copied into a name is no alias."""
    found: dict[str, str] = {}
    for node in ast.walk(scope):
        if not isinstance(node, ast.Assign):
            continue
        pairs = []
        for target in node.targets:
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs += zip(target.elts, node.value.elts)
            else:
                pairs.append((target, node.value))
        for target, value in pairs:
            field = _field(value, fields) if not isinstance(value, ast.Subscript) or \
                not isinstance(value.slice, ast.Slice) else None  # x[a:b] is a copy
            field = field or (found.get(value.id) if isinstance(value, ast.Name) else None)
            if isinstance(target, ast.Name) and field in MUTABLE | TABLES:
                found[target.id] = field
    return found


def _base(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        node = node.value
    return node


def writes(source: str, fields: set[str] = STATE, trusted: set[str] = frozenset()) -> list[tuple[int, str]]:
    """(line, field) of every write of a guarded field in a module's source. trusted: field names the
    module's own classes declare, which it may write on its objects (not through an alias)."""
    tree = ast.parse(source)
    found = []
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    # A state class's own methods write state too: `self` there is a request or a sequence.
    state_methods = {id(n) for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) and cls.name in STATE_CLASSES
                     for n in ast.walk(cls) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for scope in [tree, *functions]:
        local = aliases(scope, fields)
        own = id(scope) not in state_methods
        for node in _own_nodes(scope):
            for target in _targets(node):
                field, base = _field(target, fields), _base(target)
                if field and not (own and _is_self(target)) and field not in trusted:
                    found.append((node.lineno, field))
                elif isinstance(base, ast.Name) and base.id in local and (target is not base or not isinstance(
                        node, ast.Assign)):  # alias[...] = v, alias.x = v, alias.append(v), alias += v
                    found.append((node.lineno, f"{local[base.id]} (through {base.id})"))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in fields:
                found.append((node.lineno, node.args[1].value))
    return sorted(set(found))


def _own_nodes(scope: ast.AST) -> list[ast.AST]:
    """The nodes of a function (or of the module) outside the functions nested in it."""
    nodes, stack = [], list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        nodes.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return nodes


def product_modules() -> list[Path]:
    return sorted(path for part in PRODUCT for path in (ROOT / part).rglob("*.py"))


def test_only_the_scheduler_writes_request_and_sequence_state() -> None:
    leaks = []
    for path in product_modules():
        if path == SCHEDULER:
            continue
        source = path.read_text()
        leaks += [f"{path.relative_to(ROOT)}:{line} writes .{field}"
                  for line, field in writes(source, STATE, own_fields(ast.parse(source)) & STATE)]
    assert not leaks, ("only backend/engine/scheduler.py may write a request's or a sequence's state:\n"
                       + "\n".join(leaks))


def test_only_the_block_manager_writes_a_block_table() -> None:
    leaks = []
    for path in product_modules():
        if path == BLOCK_MANAGER:
            continue
        leaks += [f"{path.relative_to(ROOT)}:{line} writes .{field}"
                  for line, field in writes(path.read_text(), TABLES)]
        leaks += [f"{path.relative_to(ROOT)}:{node.lineno} reaches into BlockManager._tables"
                  for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.Attribute) and node.attr == "_tables"]
    assert not leaks, "only backend/engine/block_manager.py may write a block table:\n" + "\n".join(leaks)


def test_the_writers_are_where_the_writes_are() -> None:
    assert {field for _, field in writes(SCHEDULER.read_text())} >= {
        "num_computed_tokens", "token_ids", "status", "finish_reason", "outputs", "first_token", "scheduled"}
    assert {field for _, field in writes(BLOCK_MANAGER.read_text(), TABLES)} == set()  # its own `self._tables`


def test_the_trusted_names_are_the_ones_known() -> None:
    """Modules whose own classes share a name with a state field may write that name on their objects:
    these, and no others (a new one is a decision to look at, not an accident)."""
    trusted = {str(path.relative_to(ROOT)): sorted(own_fields(ast.parse(path.read_text())) & STATE)
               for path in product_modules() if path not in (SCHEDULER,)}
    trusted = {path: names for path, names in trusted.items() if names and writes(
        (ROOT / path).read_text(), set(names))}
    assert trusted == KNOWN_TRUSTED


# The event reducer's view of a request (what the dashboard draws) and the API's view of one choice.
KNOWN_TRUSTED = {
    "backend/events/state.py": ["arrival_step", "error", "finish_reason", "finished", "max_tokens",
                                "output_text", "outputs", "prompt_text", "request_id", "seq_id", "status",
                                "transfer_s"],
    "backend/server/generation.py": ["finish_reason"],
}


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
setattr(req, "finish_reason", "stop")
self.status = "mine"

class Request:
    def grow(self):
        self.seqs.append(None)

def f(req, seq):
    ids = seq.token_ids
    ids.append(7)
    times = req.times
    times.first_token = 1.0
    again = times
    again.finish = 2.0
    seqs = req.seqs
    seqs[0] = None
    n = len(ids)
    copy = list(ids)
    copy.append(1)
    head = ids[:2]
    head.append(1)
    k = seq.num_computed_tokens
    k += 1
    beam = req.beam
    beam.pending[3] = []
    return n
"""
    assert writes(source) == [(2, "num_computed_tokens"), (3, "token_ids"), (4, "token_ids"), (5, "token_ids"),
                              (6, "status"), (7, "token_ids"), (8, "num_cached_prompt_tokens"),
                              (11, "finish_reason"), (16, "seqs"), (20, "token_ids (through ids)"), (22, "first_token"),
                              (24, "finish"), (26, "seqs (through seqs)"), (35, "pending")]
    assert writes("r.finish_reason = 'stop'\n", trusted={"finish_reason"}) == []


def test_a_block_table_is_written_nowhere_else() -> None:
    source = """
seq.block_table = [1, 2]
seq.block_table.append(3)
t = blocks._tables
"""
    assert writes(source, TABLES) == [(2, "block_table"), (3, "block_table")]
