"""What TEI's request bodies share: unknown fields ignored (as serde does), truncation, order.

Shapes read from TEI's router (`router/src/http/types.rs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from poolserve.service.frontend.bodies import RequestBody
from poolserve.service.frontend.jobs import Truncate

# TEI's enum takes its variant names and their lower-case aliases
Direction = Literal["left", "right", "Left", "Right"]


class TEIBody(RequestBody):
    """A TEI body: fields TEI does not define are ignored with a log line, as TEI ignores them.

    huggingface_hub's InferenceClient adds fields of its own (`parameters`, `encoding_format`).
    """


def truncation(truncate: bool | None, direction: Direction) -> Truncate:
    """The service's truncation: TEI's `truncate` cuts to the model's limit; without it a long
    input follows --auto-truncate, and `false` refuses it even then."""
    side: Literal["left", "right"] = "left" if direction.lower() == "left" else "right"
    return Truncate(-1 if truncate else None, side, truncate)


def best_first(scores: Sequence[float]) -> list[int]:
    """Indices by descending score; ties in reverse index order (TEI sorts, then reverses)."""
    return sorted(range(len(scores)), key=scores.__getitem__)[::-1]
