"""input_type words (Cohere, Voyage, NIM) to the model's sentence-transformers prompt names."""

from __future__ import annotations

import pytest

from poolserve.frontend.input_types import PROMPTS_FOR_INPUT_TYPE, prompt_for_input_type
from poolserve.types.errors import InvalidRequestError

E5 = ("query", "passage")
NOMIC = ("search_query", "search_document", "classification", "clustering")
JINA_V3 = ("retrieval.query", "retrieval.passage", "separation", "classification", "text-matching")


@pytest.mark.parametrize(
    ("input_type", "names", "want"),
    [
        ("query", E5, "query"),
        ("document", E5, "passage"),
        ("passage", E5, "passage"),
        ("search_document", E5, "passage"),
        ("search_query", NOMIC, "search_query"),
        ("query", NOMIC, "search_query"),
        ("passage", NOMIC, "search_document"),
        ("clustering", NOMIC, "clustering"),
        ("query", JINA_V3, "retrieval.query"),
        ("document", JINA_V3, "retrieval.passage"),
        ("clustering", JINA_V3, "separation"),
        ("search_query", ("query", "search_query"), "search_query"),  # its own word first
        ("query", ("search_query", "query"), "query"),
    ],
)
def test_each_word_finds_the_prompt_that_means_it(
    input_type: str, names: tuple[str, ...], want: str
) -> None:
    assert prompt_for_input_type(input_type, names) == want


def test_a_model_without_prompts_takes_every_word() -> None:
    for input_type in PROMPTS_FOR_INPUT_TYPE:
        assert prompt_for_input_type(input_type, ()) is None


def test_a_word_without_its_prompt_is_refused_naming_the_prompts() -> None:
    with pytest.raises(InvalidRequestError, match="its prompts: passage, query") as raised:
        prompt_for_input_type("clustering", E5)
    assert raised.value.param == "input_type"
