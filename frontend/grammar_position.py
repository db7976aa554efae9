"""Where a constrained output stands in its grammar, read from the text written so far.

A request's `structured_outputs` (on its request_arrived event) names one grammar. The sampling view
says what it is and where the output is in it: the JSON path of the value being written
(`$.address.city`, `$.tags[2]`), the choices still open, or the text a regex or EBNF grammar has
matched. Read from the text alone (plain data, no xgrammar in the dashboard), so it holds for a
replay too.
"""

from __future__ import annotations

import json
import re
from typing import Any

KIND_LABELS = {"json": "JSON schema", "json_object": "any JSON object", "regex": "regex", "choice": "choice",
               "grammar": "EBNF grammar"}
KIND_TAGS = {"json": "{json}", "json_object": "{json}", "regex": "/regex/", "choice": "choice", "grammar": "ebnf"}
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def constraint(sampling: dict[str, Any] | None) -> tuple[str, Any] | None:
    """(kind, its value) of the grammar a request's sampling names; None when it names none."""
    spec = (sampling or {}).get("structured_outputs") or {}
    return next(((kind, spec[kind]) for kind in KIND_LABELS if spec.get(kind)), None)


def tagged(request_id: str, sampling: dict[str, Any] | None) -> str:
    """A request's name as its rows show it: marked with its grammar's kind when one constrains it."""
    found = constraint(sampling)
    return f"{request_id} · {KIND_TAGS[found[0]]}" if found else request_id


def json_path(text: str) -> str:
    """The path of the value being written at the end of a partial JSON text (`$` for the whole)."""
    frames: list[dict[str, Any]] = []  # open containers: {"in": "{", "key", "state"} or {"in": "[", "index"}
    in_string, escaped, chars = False, False, []
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                top = frames[-1] if frames else None
                if top is not None and top["in"] == "{" and top["state"] == "key":
                    top["key"], top["state"] = "".join(chars), "colon"
            else:
                chars.append(c)
        elif c == '"':
            in_string, chars = True, []
        elif c == "{":
            frames.append({"in": "{", "key": None, "state": "key"})
        elif c == "[":
            frames.append({"in": "[", "index": 0})
        elif c in "}]" and frames:
            frames.pop()
        elif c == ":" and frames and frames[-1]["in"] == "{":
            frames[-1]["state"] = "value"
        elif c == "," and frames:
            top = frames[-1]
            if top["in"] == "{":
                top["key"], top["state"] = None, "key"
            else:
                top["index"] += 1
    return "$" + "".join(_step(frame) for frame in frames)


def _step(frame: dict[str, Any]) -> str:
    if frame["in"] == "[":
        return f"[{frame['index']}]"
    key = frame["key"]
    if key is None:  # between two members: the object itself
        return ""
    return f".{key}" if IDENTIFIER.fullmatch(key) else f"[{json.dumps(key)}]"


def position_text(sampling: dict[str, Any] | None, before: str) -> str:
    """The grammar and where the output stands in it once `before` is written; "" when there is none."""
    found = constraint(sampling)
    if found is None:
        return ""
    kind, value = found
    label = KIND_LABELS[kind]
    if kind in ("json", "json_object"):
        return f"grammar: {label} · writing {json_path(before)}"
    if kind == "choice":
        still = [c for c in value if c.startswith(before)]
        return f"grammar: {label} of {len(value)} · still open: " + (", ".join(map(repr, still)) or "none")
    shown = value if len(value) <= 60 else value[:57] + "…"
    return f"grammar: {label} {shown!r} · matched so far: {before!r}"
