"""The Python API's `late_chunking` check takes and refuses what the server's body check does.

The server validates the object with pydantic (`LateChunkingBody`); the Python API, which loads
no HTTP module, checks it by hand: every value here gets the same record from both, or a refusal
from both (the server's 400, param `late_chunking`).
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from poolserve.frontend.spans import LateChunking
from poolserve.http.api.schemas import LateChunkingBody
from poolserve.offline.late import late_chunking_of, late_piece, with_spans
from poolserve.types.errors import InvalidRequestError

TAKEN: list[dict[str, Any]] = [
    {"chunk_size": 3},
    {"chunk_size": 1, "spans": None},
    {"spans": [[(0, 5), (5, 9)], [(0, 1)]]},
    {"spans": [[[0, 5]], []]},  # a range as a list, an input with no spans (refused later)
    {"spans": ([(0, 2)],), "chunk_size": None},  # a tuple as the array
]
REFUSED: list[Any] = [
    {},
    {"spans": None, "chunk_size": None},
    {"spans": [[(0, 5)]], "chunk_size": 3},
    {"chunk_size": 0},
    {"chunk_size": -2},
    {"chunk_size": True},
    {"chunk_size": 2.0},
    {"chunk_size": "4"},
    {"chunk_size": 3, "window": 2},
    {"spans": "0-5"},
    {"spans": [(0, 5)]},  # not one list per input
    {"spans": [[(0, 5, 9)]]},
    {"spans": [[(0,)]]},
    {"spans": [[(0.0, 5)]]},
    {"spans": [[(False, 5)]]},
    {"spans": [[{"start": 0, "end": 5}]]},
    {"spans": [["05"]]},
    [("chunk_size", 3)],
]


@pytest.mark.parametrize("value", TAKEN)
def test_taken_as_the_server_takes_it(value: dict[str, Any]) -> None:
    assert late_chunking_of(value) == LateChunkingBody.model_validate(value).job()


@pytest.mark.parametrize("value", REFUSED)
def test_refused_as_the_server_refuses_it(value: Any) -> None:
    with pytest.raises(ValidationError):
        LateChunkingBody.model_validate(value)
    with pytest.raises(InvalidRequestError) as caught:
        late_chunking_of(value)
    assert caught.value.param == "late_chunking"


def test_spans_travel_with_their_texts_into_pieces() -> None:
    late = late_chunking_of({"spans": [[(0, 1)], [(0, 2), (2, 3)], [(1, 2)]]})
    items = with_spans(["a", "bcd", "ef"], late)
    texts, piece = late_piece(items[1:], late)
    assert texts == ["bcd", "ef"]
    assert piece == LateChunking(spans=(((0, 2), (2, 3)), ((1, 2),)))
    windows = late_chunking_of({"chunk_size": 4})
    assert with_spans(["a"], windows) == ["a"]
    assert late_piece(["a"], windows) == (["a"], windows)
    with pytest.raises(InvalidRequestError) as caught:
        with_spans(["a", "b"], late)
    assert caught.value.param == "late_chunking.spans"
