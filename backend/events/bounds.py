"""What a trace may claim, checked line by line before anything is sized from it (docs/api.md, "Limits").

A trace comes from anywhere: an upload to `POST /api/runs`, a file given to `kvscope replay` or
`kvscope export`. What reads one sizes lists, tables and images from its numbers: the reducer's free
list from `cache.num_blocks`, a block table from `logical_index`, the dashboard's mask rows from
`query_positions`, a GIF's frames from the steps. A 1 KB trace naming `num_blocks = 1e7` made the
server allocate 6.4 GB. So `parse_trace` runs every event through here, once, and nothing downstream
checks again:

- `check_values`: one line alone. Nesting depth, and every integer one that an id, an index or a
  count can be: 0 <= n < 2**53 (a step may be -1); inside the free-form dicts (sampling, config, ...)
  only |n| < 2**53.
- `TraceBounds`: each event against its header and the state before it. The state is the reducer's
  own (`RunState`, fed the events already checked), so "the table is this long" means exactly what
  a replay will build: block ids inside the pool, logical indices inside the longest table the
  header's engine could build, positions under its `max_model_len`.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from kvscope.backend.config import MAX_BLOCK_SIZE, MAX_NUM_BLOCKS, EngineConfig
from kvscope.backend.errors import validation_error
from kvscope.backend.events.state import RunState

Event = dict[str, Any]
MAX_TRACE_EVENTS = 1_000_000  # lines; counted before any is parsed
MAX_TRACE_BYTES = 512 * 1024**2  # a file's size, checked before it is read (the API: --max-body-bytes)
MAX_DEPTH = 32  # arrays and objects inside each other, as for the API's bodies; a header nests 5 deep
MAX_INT = 2**53  # ids, steps and counts stay exact as JavaScript numbers, which the dashboard reads them as
# Block-table entries a trace that starts mid-run (the server's windowed /trace) leaves unknown: the
# blocks its sequences held before the window. The reducer keeps them as holes, so they are capped
# at one pool's worth in all (8 MB of list slots), not allowed per event.
MAX_UNSEEN_ENTRIES = MAX_NUM_BLOCKS
# Dict fields written by other parts (configs, sampling, the model's facts): any sign, only bounded.
FREE_FORM = frozenset({"sampling", "config", "scenario", "model", "cache", "weights", "draft_model", "simulated",
                       "dist"})
BLOCK_FIELDS = {"block_alloc": ("block_id",), "block_free": ("block_id",), "block_share": ("block_id",),
                "block_evict": ("block_id",), "block_copy": ("src_block_id", "dst_block_id")}


def check_values(event: Event) -> None:
    """Raise ValueError naming the field when the line nests too deep or holds an integer out of range."""
    stack: list[tuple[dict | list, int, str]] = [(event, 1, "")]
    while stack:
        node, depth, where = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(_where(event, where, f"nested deeper than {MAX_DEPTH} levels"))
        for key, value in node.items() if isinstance(node, dict) else enumerate(node):
            path = f"{where}.{key}" if where else str(key)
            if isinstance(value, (dict, list)):
                stack.append((value, depth + 1, path))
            elif isinstance(value, int) and not isinstance(value, bool):
                _check_int(event, path, value)


def _check_int(event: Event, path: str, value: int) -> None:
    low = -MAX_INT if path.split(".")[0] in FREE_FORM else -1 if path == "step" else 0
    if not low <= value < MAX_INT:
        bound = "negative" if value < low else "not below 2**53"
        raise ValueError(_where(event, path, f"{value} is {bound}"))


class TraceBounds:
    """Feed it a trace's events in order: `check(event)` raises ValueError for one that claims more than
    its header allows, and otherwise applies it to the state that the next event is checked against."""

    def __init__(self) -> None:
        self.state = RunState(max_iterations=1)  # block tables are what is checked; keep no past
        self.num_blocks = self.max_len = self.max_table = 0
        self.unseen = 0  # table entries before the trace's first event, over every sequence

    def check(self, event: Event) -> None:
        if event["type"] == "header":
            self._header(event)
        else:
            for name in BLOCK_FIELDS.get(event["type"], ()):
                if event[name] >= self.num_blocks:
                    raise ValueError(_where(event, name, f"block {event[name]} is outside the pool of "
                                                         f"{self.num_blocks} blocks (header cache.num_blocks)"))
            check = getattr(self, f"_{event['type']}", None)
            if check is not None:
                check(event)
        self.state.apply(event)

    def _header(self, e: Event) -> None:
        cache = e["cache"]
        for name, top in (("num_blocks", MAX_NUM_BLOCKS), ("block_size", MAX_BLOCK_SIZE)):
            if not 1 <= cache[name] <= top:
                raise ValueError(_where(e, f"cache.{name}", f"{cache[name]} is outside 1..{top:,} "
                                                            "(the engine's own range)"))
        try:  # the fields this version knows, with the engine's own ranges (others are a newer writer's)
            config = EngineConfig.model_validate({k: v for k, v in e["config"].items() if k in EngineConfig.model_fields})
        except ValidationError as error:
            bad = validation_error(error, "config")
            raise ValueError(_where(e, str(bad.field), bad.reason)) from None
        _check_lesson(e)
        self.num_blocks, self.max_len = cache["num_blocks"], config.max_model_len
        self.max_table = -(-config.max_model_len // cache["block_size"])
        self.unseen = 0

    def _block_alloc(self, e: Event) -> None:
        index = e["logical_index"]
        if index >= self.max_table:
            raise ValueError(_where(e, "logical_index", f"{index} is past the longest block table, {self.max_table} "
                                                        "blocks (header config.max_model_len / cache.block_size)"))
        self.unseen += max(0, index - len(self.state.block_tables.get(e["seq_id"], ())))
        if self.unseen > MAX_UNSEEN_ENTRIES:
            raise ValueError(_where(e, "logical_index", f"more than {MAX_UNSEEN_ENTRIES:,} block-table entries come "
                                                        "before the trace's first event"))

    _block_share = _block_alloc

    def _attention_mask(self, e: Event) -> None:
        start, end = e["query_positions"]
        if not start <= end <= e["key_len"] <= self.max_len:
            raise ValueError(_where(e, "query_positions", f"[{start}, {end}) with key_len {e['key_len']} is not "
                                                          f"start <= end <= key_len <= {self.max_len} (max_model_len)"))

    def _iteration(self, e: Event) -> None:
        for i, entry in enumerate(e["batch"]):
            if not entry["num_query_tokens"] <= entry["context_len"] <= self.max_len:
                raise ValueError(_where(e, f"batch.{i}", f"{entry['num_query_tokens']} query tokens in a context of "
                                                         f"{entry['context_len']}: not within max_model_len "
                                                         f"{self.max_len}"))

    def _token(self, e: Event) -> None:
        if e["position"] >= self.max_len:
            raise ValueError(_where(e, "position", f"{e['position']} is not below max_model_len {self.max_len}"))

    def _seq_fork(self, e: Event) -> None:
        if e["position"] > self.max_len:
            raise ValueError(_where(e, "position", f"{e['position']} is past max_model_len {self.max_len}"))


def _check_lesson(header: Event) -> None:
    """A lesson is read step by step (its moments, its texts): a list of {at, text} objects, or old traces' text."""
    lesson = (header["scenario"] or {}).get("lesson")
    if lesson is None or isinstance(lesson, str):
        return
    if not isinstance(lesson, list):
        raise ValueError(_where(header, "scenario.lesson", "a lesson is a list of {at, text} steps"))
    for i, step in enumerate(lesson):
        if not (isinstance(step, dict) and isinstance(step.get("at", "start"), str)
                and isinstance(step.get("text"), str)):
            raise ValueError(_where(header, f"scenario.lesson.{i}", "a lesson step is {at: moment, text: words}"))


def _where(event: Event, field: str, reason: str) -> str:
    """The reason, worded as schema.describe_error words a bad field."""
    return f"{event.get('type', 'an')} event: field {field!r}: {reason}"
