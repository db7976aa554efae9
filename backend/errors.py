"""The one error family of kvscope: a field and a reason, raised deep and reported once at the edge.

Every edge prints the same thing: the command line writes `str(error)` as one line and exits 2, the
REST API answers 4xx `{"error": str(error), "field": field}`, the OpenAI API puts it in its
`{"error": {"message", "param", ...}}` body. Subclasses only say where the mistake was made.
"""

from __future__ import annotations

from pydantic import ValidationError


class KvscopeError(ValueError):
    """A mistake the user can act on: `field` (a dotted config path, a flag, a file) and `reason`."""

    def __init__(self, field: str | None, reason: str) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field, self.reason = field, reason


class ModelLoadError(KvscopeError):
    """A model that cannot be used: the file or name, and the reason."""


def validation_error(error: ValidationError, prefix: str = "",
                     cls: type[KvscopeError] = KvscopeError) -> KvscopeError:
    """The first of pydantic's errors as a `cls`: field `prefix` + the dotted location, and its message."""
    first = error.errors()[0]
    loc = ".".join(str(part) for part in first["loc"])
    field = ".".join(p for p in (prefix, loc) if p) or None
    return cls(field, pydantic_reason(first["msg"]))


def pydantic_reason(msg: str) -> str:
    """The reason in one of pydantic's messages: custom validators' come prefixed with "Value error, "."""
    return msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
