"""text-embeddings-inference's `POST /rerank`: its body in, its ranked list out.

Shapes read from TEI's router (`RerankRequest`, `Rank`, the `rerank` handler in server.rs).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import ClassVar

from fastapi import Request
from pydantic import Field, StrictStr
from starlette.responses import Response

from poolserve.frontend.jobs import ScoreJob
from poolserve.http.bodies import MODE_WEIGHTS_FOREIGN
from poolserve.http.calls import score
from poolserve.http.compat.tei_common import (
    Direction,
    Ran,
    TEIBody,
    best_first,
    empty,
    mark,
    reply,
    truncation,
)


class TEIRerankRequest(TEIBody):
    """TEI's `RerankRequest` (told apart from the other rerank bodies by `texts`)."""

    foreign_fields: ClassVar[Mapping[str, str]] = {**TEIBody.foreign_fields, **MODE_WEIGHTS_FOREIGN}
    query: StrictStr
    texts: list[StrictStr]
    truncate: bool | None = Field(
        None, description="Cut long pairs to the model's limit (unset: cut, as TEI >= 1.9)."
    )
    # TEI's enum deserializes its variant names, Left and Right; its docs write them lower case
    truncation_direction: Direction = "Right"
    raw_scores: bool = Field(False, description="The raw logit instead of the sigmoid.")
    return_text: bool = Field(False, description="Include each text.")


async def rerank(body: TEIRerankRequest, request: Request) -> Response:
    """TEI's answer: `[{"index", "text"?, "score"}]`, best first."""
    mark(request)
    started = time.monotonic()
    if not body.texts:
        raise empty("texts")
    job = ScoreJob.one_query(
        body.query,
        body.texts,
        "texts",
        truncate=truncation(body.truncate, body.truncation_direction),
        use_activation=not body.raw_scores,
    )
    scored = await score(request, job)
    # TEI counts the query once per text
    chars = len(body.query) * len(body.texts) + sum(len(text) for text in body.texts)
    ran = Ran.of(scored.outputs, time.monotonic() - started, chars)
    scores = scored.scores
    # TEI sorts ascending, then reverses: equal scores come out in reverse input order
    if body.return_text:
        ranks = [
            {"index": i, "text": body.texts[i], "score": scores[i]} for i in best_first(scores)
        ]
    else:
        ranks = [{"index": i, "score": scores[i]} for i in best_first(scores)]
    return await reply(request, started, ran, lambda: ranks)
