"""text-embeddings-inference's `POST /rerank`: its body in, its ranked list out.

Shapes read from TEI's router (`RerankRequest`, `Rank`, the `rerank` handler in server.rs).
"""

from __future__ import annotations

from collections.abc import Sequence

from poolserve.service.pairs import ScoreJob
from poolserve.service.schemas import TEIRerankRequest


def to_job(body: TEIRerankRequest) -> ScoreJob:
    """The service's scoring job for a TEI rerank body."""
    return ScoreJob.one_query(
        body.query,
        body.texts,
        "texts",
        # TEI's truncate cuts to the model's limit; without it a long pair is refused
        truncate_prompt_tokens=-1 if body.truncate else None,
        truncation_side="left" if body.truncation_direction.lower() == "left" else "right",
        truncate=body.truncate,
        use_activation=not body.raw_scores,
    )


def ranks(body: TEIRerankRequest, scores: Sequence[float]) -> list[dict[str, object]]:
    """TEI's answer: `[{"index", "text"?, "score"}]`, best first."""
    # TEI sorts ascending, then reverses: equal scores come out in reverse input order
    order = sorted(range(len(scores)), key=scores.__getitem__)[::-1]
    if body.return_text:
        return [{"index": i, "text": body.texts[i], "score": scores[i]} for i in order]
    return [{"index": i, "score": scores[i]} for i in order]
