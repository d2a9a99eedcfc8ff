"""A client's `input_type` (Cohere, Voyage, NIM) as the model's sentence-transformers prompt.

Asymmetric retrieval models embed queries and documents with different prompts (E5's "query: "
and "passage: ", BGE's and Qwen3-Embedding's query instruction, nomic's "search_query: ");
`config_sentence_transformers.json` names them, and jina-embeddings-v3 names its task adapters
the same way. Each API says which side a text is with its own words; this table maps every word
to the prompt names that mean it, the word itself first.

A model with prompts but none for the type asked is refused: falling back to its default prompt
would embed a document with the query's instruction, silently. A model with no prompts at all
is symmetric: every type embeds the same way, as upstream servers do for such models.
"""

from __future__ import annotations

from collections.abc import Sequence

from poolserve.types.errors import InvalidRequestError

QUERY_PROMPTS = ("query", "search_query", "retrieval.query")
DOCUMENT_PROMPTS = ("document", "passage", "search_document", "corpus", "retrieval.passage")

# every input_type any served API sends -> the prompt names that mean it
PROMPTS_FOR_INPUT_TYPE: dict[str, tuple[str, ...]] = {
    "query": QUERY_PROMPTS,  # Voyage, NIM
    "search_query": QUERY_PROMPTS,  # Cohere
    "document": DOCUMENT_PROMPTS,  # Voyage
    "passage": DOCUMENT_PROMPTS,  # NIM
    "search_document": DOCUMENT_PROMPTS,  # Cohere
    "classification": ("classification",),  # Cohere; jina-v3's adapter of that name
    "clustering": ("clustering", "separation"),  # Cohere; jina-v3 calls it separation
}


def prompt_names_for(input_type: str) -> tuple[str, ...]:
    """The prompt names an input_type selects, most specific (its own word) first."""
    names = PROMPTS_FOR_INPUT_TYPE[input_type]
    return tuple(dict.fromkeys((input_type, *names)))


def prompt_for_input_type(input_type: str, prompt_names: Sequence[str]) -> str | None:
    """The model's prompt name for `input_type` (None: a model without prompts); else a 400."""
    if not prompt_names:
        return None
    for name in prompt_names_for(input_type):
        if name in prompt_names:
            return name
    raise InvalidRequestError(
        f"input_type {input_type!r} has no prompt in this model (its prompts: "
        f"{', '.join(sorted(prompt_names))}); send prompt_name or prompt to choose one",
        "input_type",
    )
