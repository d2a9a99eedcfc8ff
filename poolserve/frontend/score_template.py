"""A model's score template: which one applies (found once at start) and one pair rendered by it.

A score template is a Jinja chat template in vLLM's form: the pair arrives as `messages`, one
with the role `query` and one with the role `document`, plus the variables `query`, `document`
and `instruction` and the request's `chat_template_kwargs`. The first that applies wins:
`--score-template` (a file or the template itself; `none`: no template, the texts joined as
vLLM joins them), the checkpoint's own chat template when it names both roles (as
sentence-transformers v6 rerankers ship it, their default prompt its instruction), the model
card's recipe of a known LLM reranker (`score_recipes.py`), else none: a cross-encoder keeps the
tokenizer's pair layout.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from poolserve.config.settings import ServerSettings
from poolserve.frontend.score_recipes import recipe_of
from poolserve.types.card import ModelCard
from poolserve.types.errors import InvalidRequestError, clip

NO_TEMPLATE = "none"  # --score-template none: the texts joined, as vLLM does without a template
# what a template names when it reads the pair by role (vLLM's and sentence-transformers' form)
PAIR_ROLE = {role: re.compile(rf"""["']{role}["']""") for role in ("query", "document")}
# what a broken template, or a pair it refuses, raises while rendering
RENDER_ERRORS = (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)
# probe texts: a render that holds them carries the pair; two instructions that render
# differently prove an instruction slot
PROBE_QUERY, PROBE_DOCUMENT = "\ue000poolserve-query\ue000", "\ue000poolserve-document\ue000"
PROBE_INSTRUCTIONS = ("\ue000poolserve-instruction-1\ue000", "\ue000poolserve-instruction-2\ue000")


@dataclass(frozen=True)
class ScoreTemplate:
    """The template a model's pairs are rendered with, and how it takes an instruction."""

    source: str  # the Jinja text
    origin: str  # where it came from, as start-up logs and errors say
    default_instruction: str | None  # given when a request sends none (None: the template's own)
    has_instruction: bool  # the instruction changes the prompt (else a request's is ignored)
    system_instruction: bool = False  # it also travels as a leading system message (ST v6)


def render_pair(
    tokenizer: PreTrainedTokenizerBase,
    template: ScoreTemplate,
    query: str,
    document: str,
    instruction: str | None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """One pair's prompt text: the request's instruction, else the template's default."""
    variables: dict[str, Any] = dict(template_kwargs or {})
    given = instruction if instruction is not None else variables.get("instruction")
    chosen = given if given is not None else template.default_instruction
    messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
    if chosen is not None:
        variables["instruction"] = chosen
        if template.system_instruction:
            messages.insert(0, {"role": "system", "content": chosen})
    variables.update(query=query, document=document)
    for reserved in ("conversation", "chat_template", "tokenize", "tools", "documents"):
        variables.pop(reserved, None)
    try:
        text = tokenizer.apply_chat_template(
            messages, chat_template=template.source, tokenize=False, **variables
        )
    except RENDER_ERRORS as exc:
        raise InvalidRequestError(
            f"the score template ({template.origin}) could not render the pair: {clip(str(exc))}",
            "instruction",
        ) from None
    if not isinstance(text, str) or not text:
        raise InvalidRequestError(
            f"the score template ({template.origin}) rendered the pair as nothing", "query"
        )
    return text


def score_template_of(
    card: ModelCard, settings: ServerSettings, tokenizer: PreTrainedTokenizerBase
) -> ScoreTemplate | None:
    """The template this model's pairs are scored with (None: the tokenizer's pair layout, or
    the texts joined); a --score-template that is neither a file nor a template is refused."""
    given = settings.score_template
    if given is not None and given.strip().lower() == NO_TEMPLATE:
        return None
    if given is not None:
        return _probed(tokenizer, _read(given), "--score-template", None)
    own = tokenizer.chat_template
    if isinstance(own, str) and all(p.search(own) for p in PAIR_ROLE.values()):
        st = card.sentence_transformers
        prompts = dict(st.prompts) if st is not None else {}
        default = prompts.get(st.default_prompt_name or "") if st is not None else None
        template = _probed(tokenizer, own, "the checkpoint's chat template", default, True)
        if template is not None:
            return template
    recipe = recipe_of(card, settings.model)
    if recipe is None:
        return None
    origin = f"the {recipe.name} model card's prompt"
    return _probed(tokenizer, recipe.template, origin, recipe.default_instruction)


def _read(given: str) -> str:
    """--score-template's Jinja: a file's text, or the value itself when it is a template."""
    path = Path(given).expanduser()
    if "{{" not in given and "{%" not in given:
        if not path.is_file():
            raise ValueError(f"--score-template {given!r}: no such file, and not a Jinja template")
        return path.read_text(encoding="utf-8")
    return given


def _probed(
    tokenizer: PreTrainedTokenizerBase,
    source: str,
    origin: str,
    default: str | None,
    system_instruction: bool = False,
) -> ScoreTemplate | None:
    """The template when it renders a probe pair holding both texts; None for a checkpoint's
    template that does not, a start-up error for one the server was told to use."""
    template = ScoreTemplate(source, origin, default, False, system_instruction)
    try:
        renders = [
            render_pair(tokenizer, template, PROBE_QUERY, PROBE_DOCUMENT, probe)
            for probe in PROBE_INSTRUCTIONS
        ]
        carried = all(PROBE_QUERY in text and PROBE_DOCUMENT in text for text in renders)
        why = "it does not render both the query and the document"
    except InvalidRequestError as exc:
        carried, why = False, exc.message
    if not carried:
        if origin == "--score-template":
            raise ValueError(f"--score-template cannot score a pair: {why}")
        return None
    return ScoreTemplate(source, origin, default, renders[0] != renders[1], system_instruction)
