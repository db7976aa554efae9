"""What crosses from rank 0 to a tensor-parallel worker, as plain data a worker checks before it acts.

Three messages, each a JSON body inside a frame signed with the run's secret (tp_auth.py), never a
pickle: decoding JSON runs no code, whatever the bytes say.
- a session (tp_worker.py): the device, the collective timeout, the threads; or `exit`;
- the worker's spec, once: the model's config, its rank, how each layer of its shard is stored
  (model/shard_spec.py), its KV pool, and the SHA-256 of the state dict that follows over the process
  group (tensors only: `torch.load(weights_only=True)`);
- each step: the forward's part of a StepInput (step_input.py): token ids, positions, slots, the rows'
  query offsets, context lengths and block tables, the copy-on-write pairs. Not the sampling (rank 0
  samples) nor the request ids (names a client chose, which no worker needs).

`decode_step` checks every field against StepInput's own annotation (list[int], list[list[int]],
list[tuple[int, int]], the Phase literal), then the lengths and ranges a forward relies on: every
block id inside the worker's pool, every token inside the vocabulary, rows that add up. An index past
the pool is an exception on a CPU, but an out-of-bounds write in a GPU kernel. A message that fails
raises Refused naming the field; the worker stops and says why (tp_worker.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any, Literal, get_args, get_origin, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvscope.backend.config import MAX_BLOCK_SIZE, MAX_NUM_BLOCKS, KVCacheDtype, ModelConfig
from kvscope.backend.engine.step_input import StepInput
from kvscope.backend.engine.tp_auth import Refused
from kvscope.backend.model.shard_spec import FloatName, ShardStorage
from kvscope.backend.model.sharding import MAX_TENSOR_PARALLEL

WIRE_FIELDS = ("seq_ids", "phases", "query_starts", "context_lens", "block_tables", "input_ids", "positions",
               "slot_mapping", "logit_rows", "block_copies")
HINTS = {name: hint for name, hint in get_type_hints(StepInput).items() if name in WIRE_FIELDS}
MAX_POSITION = 1 << 31  # a position past this is no sequence's (and would wrap in the kernels' int32)
MAX_THREADS = 4096
MAX_TIMEOUT_S = 86_400.0


def _compact(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def _parse(body: bytes, what: str) -> Any:
    """JSON, with NaN and Infinity refused and nesting bounded by the parser's recursion limit."""
    def no_constant(name: str) -> None:
        raise ValueError(f"{name} is not a number")
    try:
        return json.loads(body, parse_constant=no_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise Refused(f"the {what} is not JSON ({type(e).__name__})") from None


# ---- sessions ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Session:
    """How rank 0 opens a session: its number (the store prefix), the device type, the timeout, threads."""

    number: int
    device: Literal["cpu", "cuda"]
    timeout_s: float
    threads: int

    def prefix(self) -> str:
        return f"session/{self.number}/"


def encode_session(session: Session | None) -> bytes:
    """A session's body; None: the workers exit."""
    if session is None:
        return _compact({"exit": True})
    return _compact({"device": session.device, "timeout_s": session.timeout_s, "threads": session.threads})


def decode_session(body: bytes, number: int) -> Session | None:
    message = _parse(body, "session")
    if message == {"exit": True}:
        return None
    if not isinstance(message, dict) or message.keys() != {"device", "timeout_s", "threads"}:
        raise Refused("the session is not {device, timeout_s, threads}")
    device, timeout, threads = message["device"], message["timeout_s"], message["threads"]
    if device not in ("cpu", "cuda"):
        raise Refused("the session's device is neither cpu nor cuda")
    if type(timeout) not in (int, float) or not 0 < timeout <= MAX_TIMEOUT_S:
        raise Refused(f"the session's timeout_s is not a number in (0, {MAX_TIMEOUT_S:g}]")
    if type(threads) is not int or not 1 <= threads <= MAX_THREADS:
        raise Refused(f"the session's threads is not a whole number in [1, {MAX_THREADS}]")
    return Session(number, device, float(timeout), threads)


# ---- the worker's spec ------------------------------------------------------------------------------


class WorkerSpec(BaseModel):
    """What rank 0 tells a worker once: its shard's shape and storage, its KV pool, the state dict's digest."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    config: ModelConfig
    rank: int = Field(ge=1, lt=MAX_TENSOR_PARALLEL)
    world: int = Field(ge=2, le=MAX_TENSOR_PARALLEL)
    storage: ShardStorage
    dtype: FloatName  # the model's float dtype
    num_blocks: int = Field(ge=1, le=MAX_NUM_BLOCKS)
    block_size: int = Field(ge=1, le=MAX_BLOCK_SIZE)
    kv_dtype: KVCacheDtype
    attention: Literal["torch", "triton"]
    state_bytes: int = Field(ge=0)
    state_sha256: str = Field(pattern="^[0-9a-f]{64}$")

    @model_validator(mode="after")
    def _rank_in_world(self) -> "WorkerSpec":
        if self.rank >= self.world:
            raise ValueError(f"rank {self.rank} of {self.world} ranks")
        return self


def decode_spec(body: bytes, rank: int, world: int) -> WorkerSpec:
    try:
        spec = WorkerSpec.model_validate_json(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "spec"
        raise Refused(f"the worker spec's {where}: {first['msg']}") from None
    if (spec.rank, spec.world) != (rank, world):
        raise Refused(f"the worker spec is for rank {spec.rank} of {spec.world}; this is rank {rank} of {world}")
    return spec


# ---- steps -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pool:
    """What a worker's forward may address: its KV pool's blocks and the model's vocabulary."""

    num_blocks: int
    block_size: int
    vocab_size: int


def encode_step(inp: StepInput | None) -> bytes:
    """A step's body for the workers; None: the session ends."""
    if inp is None:
        return _compact({"stop": True})
    return _compact({"step": {name: getattr(inp, name) for name in WIRE_FIELDS}})


def decode_step(body: bytes, pool: Pool) -> StepInput | None:
    """The StepInput a step's body carries (request ids left empty, no sampling), once every field has
    StepInput's type and the forward's bounds; None for the session's end; Refused naming the field."""
    message = _parse(body, "step message")
    if message == {"stop": True}:
        return None
    fields = message.get("step") if isinstance(message, dict) and message.keys() == {"step"} else None
    if not isinstance(fields, dict) or fields.keys() != set(WIRE_FIELDS):
        raise Refused(f"the step message is not {{step: {{{', '.join(WIRE_FIELDS)}}}}}")
    for name, check in CHECKS.items():
        if not check(fields[name]):
            raise Refused(f"the step message's {name} is not a {_spell(HINTS[name])}")
    check_bounds(fields, pool)
    rows = len(fields["seq_ids"])
    return StepInput(request_ids=[""] * rows, **{**fields, "block_copies": [tuple(p) for p in fields["block_copies"]]})


def type_check(hint: Any) -> Callable[[Any], bool]:
    """A test of whether decoded JSON has the type `hint` names, built once per field: int (not bool), str, a
    Literal's values, list[...] and tuple[...] (a JSON list of that length)."""
    if hint is int:
        return lambda v: type(v) is int
    if hint is str:
        return lambda v: type(v) is str
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        allowed, types = {(type(a), a) for a in args}, {type(a) for a in args}
        return lambda v: type(v) in types and (type(v), v) in allowed  # a list never reaches the hash
    if origin is list and args[0] is int:  # the long lists (a token each): the types gathered in C
        return lambda v: type(v) is list and set(map(type, v)) <= {int}
    if origin is list:
        item = type_check(args[0])
        return lambda v: type(v) is list and all(map(item, v))
    if origin is tuple:
        items = [type_check(a) for a in args]
        return lambda v: type(v) is list and len(v) == len(items) and all(c(x) for c, x in zip(items, v))
    raise TypeError(f"no wire check for {hint}")


CHECKS = {name: type_check(hint) for name, hint in HINTS.items()}


def _spell(hint: Any) -> str:
    return str(hint).replace("typing.", "")


def check_bounds(f: dict[str, Any], pool: Pool) -> None:
    """The lengths and ranges the forward indexes by (types already checked). Each check runs over a whole
    field in C (min, max, zip), since a worker does this every step."""
    rows, tokens, starts = len(f["seq_ids"]), len(f["input_ids"]), f["query_starts"]
    for name in ("phases", "context_lens", "block_tables"):
        if len(f[name]) != rows:
            _refuse(f"{name} has {len(f[name])} rows, seq_ids {rows}")
    for name in ("positions", "slot_mapping"):
        if len(f[name]) != tokens:
            _refuse(f"{name} has {len(f[name])} entries, input_ids {tokens}")
    if len(starts) != rows + 1 or starts[0] != 0 or starts[-1] != tokens:
        _refuse("query_starts do not span the tokens")
    queries = [b - a for a, b in zip(starts, starts[1:])]
    if queries and min(queries) < 0:
        _refuse("query_starts go backwards")
    _within(f["input_ids"], pool.vocab_size, "input_ids", "the vocabulary")
    _within(f["positions"], MAX_POSITION, "positions", "2^31")
    _within(f["slot_mapping"], pool.num_blocks * pool.block_size, "slot_mapping", "the KV pool")
    _within(f["logit_rows"], tokens, "logit_rows", "the tokens")
    _within(list(chain.from_iterable(f["block_copies"])), pool.num_blocks, "block_copies", "the KV pool")
    _within(list(chain.from_iterable(f["block_tables"])), pool.num_blocks, "block_tables", "the KV pool")
    for row, (table, context, q) in enumerate(zip(f["block_tables"], f["context_lens"], queries, strict=True)):
        if not q <= context <= len(table) * pool.block_size:
            _refuse(f"context_lens[{row}] ({context}) is outside its {q} queries and {len(table)} blocks")


def _within(values: list[int], end: int, name: str, what: str) -> None:
    if values and (min(values) < 0 or max(values) >= end):
        _refuse(f"{name} reach outside {what} (0..{end - 1})")


def _refuse(problem: str) -> None:
    raise Refused(f"the step message's {problem}")
