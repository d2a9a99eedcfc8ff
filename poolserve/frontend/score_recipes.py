"""The prompt recipes of LLM rerankers, from their model cards, and which checkpoint is which.

Each recipe is a Jinja score template in vLLM's form (the pair as `messages` with the roles
`query` and `document`; here also the plain variables `query`, `document` and `instruction`),
written from the model card's own recipe, character for character (docs/models.md shows each
prompt). A checkpoint is known by its family with either the LM-head tokens it is scored
through (`classifier_from_token`, vLLM's `hf_overrides`) or its name (a converted checkpoint,
such as a `-seq-cls` one, keeps the name and loses the tokens).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from poolserve.types.card import ModelCard

# Jinja drops one newline at a template's end: a comment after it keeps the recipe's last newline
END = "{# end #}"
QWEN3_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".'
)
QWEN3_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
# Qwen/Qwen3-Reranker-*: ChatML, the card's system prompt, <Instruct>/<Query>/<Document>, then
# the assistant's turn after an empty thinking block.
QWEN3_TEMPLATE = (
    f"<|im_start|>system\n{QWEN3_SYSTEM}<|im_end|>\n<|im_start|>user\n"
    "<Instruct>: {{ instruction }}\n<Query>: {{ query }}\n<Document>: {{ document }}"
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n" + END
)

BGE_GEMMA_PROMPT = (
    "Given a query A and a passage B, determine whether the passage contains an answer to the "
    "query by providing a prediction of either 'Yes' or 'No'."
)
# BAAI/bge-reranker-v2-gemma (FlagEmbedding's LLM reranker): the tokenizer's <bos> (added by
# the tokenizer itself), "A: query", "B: passage", then the task prompt, which the instruction
# replaces (FlagEmbedding's `prompt`).
BGE_GEMMA_TEMPLATE = "A: {{ query }}\nB: {{ document }}\n{{ instruction }}"

MXBAI_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
MXBAI_TASK = (
    "You are a search relevance expert who evaluates how well documents match search queries. "
    "For each query-document pair, carefully analyze the semantic relationship between them, "
    "then provide your binary relevance judgment (0 for not relevant, 1 for relevant).\n"
    "Relevance:"
)
# mixedbread-ai/mxbai-rerank-*-v2 (the mxbai-rerank package): ChatML around "query: ...",
# "document: ...", the task prompt; an instruction, when given, is a line before the query.
MXBAI_TEMPLATE = (
    f"<|im_start|>system\n{MXBAI_SYSTEM}<|im_end|>\n<|im_start|>user\n"
    "{% if instruction %}instruction: {{ instruction }}\n{% endif %}"
    "query: {{ query }}\ndocument: {{ document }}\n"
    f"{MXBAI_TASK}<|im_end|>\n<|im_start|>assistant\n" + END
)


@dataclass(frozen=True)
class Recipe:
    """One model card's prompt: the checkpoints it is for, its template, its instruction."""

    name: str  # as docs/models.md names it
    families: frozenset[str]  # config.json model_type
    tokens: tuple[str, ...]  # classifier_from_token of the original checkpoint
    names: re.Pattern[str]  # the checkpoint's name (Hub id or directory)
    template: str
    default_instruction: str | None  # given to the template when a request sends none


RECIPES: tuple[Recipe, ...] = (
    Recipe(
        "Qwen3-Reranker",
        frozenset({"qwen3"}),
        ("no", "yes"),
        re.compile(r"qwen3-reranker", re.IGNORECASE),
        QWEN3_TEMPLATE,
        QWEN3_INSTRUCTION,
    ),
    Recipe(
        "bge-reranker-v2-gemma",
        frozenset({"gemma"}),
        ("Yes",),
        re.compile(r"bge-reranker-v2-gemma", re.IGNORECASE),
        BGE_GEMMA_TEMPLATE,
        BGE_GEMMA_PROMPT,
    ),
    Recipe(
        "mxbai-rerank-v2",
        frozenset({"qwen2"}),
        ("0", "1"),
        re.compile(r"mxbai-rerank-(?:xsmall|base|large)-v2", re.IGNORECASE),
        MXBAI_TEMPLATE,
        None,
    ),
)


def recipe_of(card: ModelCard, name: str | None) -> Recipe | None:
    """The recipe of a served checkpoint: its family, then its LM-head tokens or its name (the
    --model value or the directory it was loaded from); None when no card's recipe applies."""
    names = f"{name or ''} {card.path}"
    for recipe in RECIPES:
        if card.family not in recipe.families:
            continue
        if card.score_tokens == recipe.tokens or recipe.names.search(names):
            return recipe
    return None
