"""Late chunking in the Python API: the wire's `late_chunking` object as the front end's record.

The object is checked as the server checks a body's (docs/api.md: the same refusals, param
`late_chunking`), here without pydantic, which only `config/` and `http/` use. A call's spans
travel with their texts, so a call cut into pieces keeps each text's own spans.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

from poolserve.frontend.spans import FIELD, LateChunking, Span
from poolserve.types.errors import InvalidRequestError

FORMS = frozenset({"spans", "chunk_size"})


def late_chunking_of(value: Mapping[str, Any]) -> LateChunking:
    """The record of a `{"spans": [[(start, end), ...] per input]}` or `{"chunk_size": n}`;
    an unknown key, both forms or neither, a non-positive size, a bad range: a 400 error."""
    if not isinstance(value, Mapping):
        raise _refused(f"late_chunking must be an object, not {type(value).__name__}")
    unknown = [key for key in value if key not in FORMS]
    if unknown:
        raise _refused(f"late_chunking takes spans or chunk_size, not {unknown[0]!r}")
    spans, chunk_size = value.get("spans"), value.get("chunk_size")
    if (spans is None) == (chunk_size is None):
        raise _refused("late_chunking takes exactly one of spans and chunk_size")
    if spans is None:
        if not _is_int(chunk_size) or chunk_size <= 0:
            raise _refused("late_chunking.chunk_size must be a positive integer")
        return LateChunking(chunk_size=chunk_size)
    return LateChunking(spans=tuple(_ranges(ranges) for ranges in _listed(spans, "spans")))


def with_spans(items: list[Any], late: LateChunking | None) -> list[Any]:
    """Each text paired with its own spans when late chunking names spans, so they stay
    together when the call is cut into pieces; else the items as they are."""
    if late is None or late.spans is None:
        return items
    if len(late.spans) != len(items):
        message = f"spans has {len(late.spans)} lists for {len(items)} inputs: send one per input"
        raise InvalidRequestError(message, f"{FIELD}.spans")
    return list(zip(items, late.spans, strict=True))


def late_piece(
    items: list[Any], late: LateChunking | None
) -> tuple[list[Any], LateChunking | None]:
    """A piece's inputs and its own late-chunking record (its texts' spans only)."""
    if late is None or late.spans is None:
        return items, late
    return [text for text, _ in items], LateChunking(tuple(spans for _, spans in items))


def _ranges(ranges: object) -> tuple[Span, ...]:
    """One input's ranges, each two integers."""
    spans = []
    for pair in _listed(ranges, "spans"):
        if not (_is_pair(pair) and _is_int(pair[0]) and _is_int(pair[1])):
            raise _refused("late_chunking.spans: each range is two integers [start, end)")
        spans.append((pair[0], pair[1]))
    return tuple(spans)


def _listed(value: object, name: str) -> Sequence[Any]:
    """A list (or tuple) as the wire's array, else a 400 naming the field."""
    if not isinstance(value, list | tuple):
        raise _refused(f"late_chunking.{name} must be a list, not {type(value).__name__}")
    return value


def _is_pair(value: object) -> TypeGuard[Sequence[Any]]:
    """A range as the wire sends it: a list (or tuple) of two items."""
    return isinstance(value, list | tuple) and len(value) == 2


def _is_int(value: object) -> TypeGuard[int]:
    """An integer as a JSON body's strict integer is: not a bool, not a float."""
    return isinstance(value, int) and not isinstance(value, bool)


def _refused(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, FIELD)
