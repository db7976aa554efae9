"""Whether an answer a grammar let through is what the client asked for: one of the choices, JSON that
parses, JSON that follows the schema.

The engine samples under xgrammar's grammar and lets EOS through only where the grammar may end, but the
grammar is xgrammar's reading of the schema, and some constraints it cannot express: a number range of
[1e-300, 2e-300] compiled to a grammar whose only answer is the empty one, which is not JSON at all (it
was answered `""` with `finish_reason: stop`). So an answer that ended at the grammar's own end is
checked against what the client sent before it is reported; one that fails is the request's error
(generation.py), never `stop`. An answer a stop string or max_tokens cut is reported as cut, unchecked.

The schema is the client's, so the check is bounded: `pattern` is left to the grammar (xgrammar enforces
it; Python's `re` can take exponential time on a hostile one) and a schema with `patternProperties` is not
checked at all; `uniqueItems` compares canonical texts (n log n, where jsonschema's falls back to n^2);
every keyword evaluated spends from a budget (oneOf over a chain of $refs doubles the work per link),
and past it the answer is left as the grammar made it. No reference is fetched: only the schema's own
definitions and the JSON Schema specifications resolve.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

# keyword evaluations for one answer: ~0.25 s on a loaded 2-core machine, far past what any real schema needs
KEYWORD_BUDGET = 20_000


class TooMuchWork(Exception):
    """The check spent its budget: the answer is left as the grammar made it."""


def answer_problem(outputs: dict[str, Any], text: str) -> str | None:
    """Why `text` is not what the grammar's source asked for (the engine's structured_outputs dict), or None
    when it is, or when it cannot be told (a regex or EBNF grammar: the grammar is the only definition)."""
    (kind, value), = outputs.items()
    if kind == "choice":
        return None if text in value else "the answer is not one of the choices"
    if kind not in ("json", "json_object"):
        return None
    try:
        answer = json.loads(text)
    except json.JSONDecodeError as e:
        return f"the answer is not JSON ({e.msg} at character {e.pos} of {len(text)})"
    except RecursionError:
        return None  # deeper than Python reads, yet grammatical JSON: nothing more to tell
    if kind == "json_object":
        return None if isinstance(answer, dict) else "the answer is JSON but not an object"
    schema = json.loads(value) if isinstance(value, str) else value
    return schema_problem(schema, answer)


def schema_problem(schema: Any, answer: Any) -> str | None:
    """The first way the answer breaks the schema, or None (also when the check cannot tell within bounds)."""
    if not isinstance(schema, dict) or "patternProperties" in json.dumps(schema):
        return None
    from jsonschema import exceptions, validators  # only requests with a schema pay for the import
    from jsonschema_specifications import REGISTRY

    budget = [KEYWORD_BUDGET]
    base = validators.validator_for(schema, default=validators.Draft202012Validator)
    checks = {keyword: _spending(check, budget) for keyword, check in base.VALIDATORS.items()}
    checks.update(pattern=_spending(_left_to_the_grammar, budget), uniqueItems=_spending(_unique_items, budget))
    bounded = validators.extend(base, checks)
    try:
        error = exceptions.best_match(bounded(schema, registry=REGISTRY).iter_errors(answer))
    except (TooMuchWork, RecursionError):
        return None
    except Exception:  # noqa: BLE001 - a schema xgrammar took and jsonschema cannot use (an unresolvable ref)
        return None
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"the answer does not follow the schema at {where or 'its root'}: {error.message[:200]}"


Check = Callable[..., Iterator[Any] | None]


def _spending(check: Check, budget: list[int]) -> Check:
    def spent(validator: Any, value: Any, instance: Any, schema: Any) -> Iterator[Any]:
        budget[0] -= 1
        if budget[0] < 0:
            raise TooMuchWork
        yield from check(validator, value, instance, schema) or ()

    return spent


def _left_to_the_grammar(validator: Any, value: Any, instance: Any, schema: Any) -> Iterator[Any]:
    return iter(())


def _unique_items(validator: Any, unique: Any, instance: Any, schema: Any) -> Iterator[Any]:
    from jsonschema.exceptions import ValidationError

    if unique and validator.is_type(instance, "array"):
        texts = sorted(json.dumps(item, sort_keys=True) for item in instance)
        if any(a == b for a, b in zip(texts, texts[1:])):
            yield ValidationError(f"{len(instance) - len(set(texts))} items are repeated (uniqueItems)")
