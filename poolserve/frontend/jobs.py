"""The front end's jobs: what every route, native or compat, hands to the one submit pipeline.

A route translates its body into one of these frozen records; `pipeline.submit` does the rest
(serving checks, parameters, admission, tokenization, submission, accounting), whatever the
route and client family. A job's pooling parameters resolve in one place, `merge`: the
request's own, then the server's `--pooler-config`, then the model's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

from poolserve.config.pooler import PoolerDefaults
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingTask
from poolserve.types.validation import FIELD_TASKS

if TYPE_CHECKING:  # spans.py reads the job records: only the type is needed here
    from poolserve.frontend.spans import LateChunking

logger = logging.getLogger(__name__)

TruncationSide = Literal["left", "right"]


@dataclass(frozen=True)
class Truncate:
    """What a request asked of truncation, before the model's limits apply."""

    tokens: int | None = None  # keep this many tokens (-1: the model's limit); None: none asked
    side: TruncationSide | None = None  # None: the tokenizer's own side
    auto: bool | None = None  # TEI's yes/no: None follows --auto-truncate, False refuses


@dataclass(frozen=True)
class Requested:
    """A request's own pooling parameters; None: unset (then --pooler-config, then the model)."""

    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    step_tag_id: int | None = None
    returned_token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Chat:
    """vLLM's chat form: one conversation rendered with the model's chat template."""

    messages: tuple[Mapping[str, Any], ...]  # as chat templates read them: role, content, ...
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False


@dataclass(frozen=True)
class TextJob:
    """Inputs pooled one prompt each: texts, token ids, or one chat conversation."""

    task: PoolingTask
    inputs: object = None  # str | list[str] | token ids | list of token-id lists (schema-checked)
    chats: tuple[Chat, ...] | None = None  # one prompt per conversation (vLLM's chat forms)
    requested: Requested = field(default_factory=Requested)
    model: str | None = None
    prompt_name: str | None = None  # sentence-transformers prompts (literal `prompt` wins)
    prompt: str | None = None
    truncate: Truncate = field(default_factory=Truncate)
    add_special_tokens: bool | None = None  # None: true for inputs, false for a chat template's
    priority: int = 0
    late_chunking: LateChunking | None = None  # one embedding per span of each text (spans.py)
    adapter: str | None = None  # Jina's `task`: the LoRA adapter to run (frontend/adapters.py)
    input_type: str | None = None  # query, document, ...: the prompt it means (input_types.py)


@dataclass(frozen=True)
class ScoreJob:
    """Text pairs scored (or classified) together, whichever client family sent them."""

    queries: tuple[str, ...]
    documents: tuple[str, ...]
    pairs: tuple[tuple[int, int], ...]  # (query index, document index), in answer order
    query_field: str  # the request's names for the two sides, for error messages
    document_field: str
    model: str | None = None
    truncate: Truncate = field(default_factory=Truncate)
    max_tokens_per_doc: int | None = None  # documents' own cap, before the pair's
    max_tokens_per_query: int | None = None  # queries' own cap, before the pair's
    use_activation: bool | None = None
    priority: int = 0
    # SCORE: the model's scorer (cross-encoder, yes/no, cosine, MaxSim); CLASSIFY: each pair laid
    # out as one prompt and classified (TEI's /predict of pairs)
    task: PoolingTask = PoolingTask.SCORE
    # vLLM's score-template fields: the instruction slot's text (None: the model's default) and
    # the template's further variables (chat_template_kwargs)
    instruction: str | None = None
    template_kwargs: Mapping[str, Any] | None = None
    # FlagEmbedding's weights_for_different_modes (dense, sparse, ColBERT): bge-m3's combined
    # score of each pair; None: the model's scorer
    mode_weights: tuple[float, ...] | None = None
    # vLLM's multimodal documents, each a text or an image, for a vision-language model that
    # reads an image document inside its score template's prompt (score_images.py); then
    # `documents` holds each text, "" for an image. (): the documents are texts
    document_items: tuple[MediaItem, ...] = ()

    @classmethod
    def one_query(
        cls, query: str, documents: Sequence[str], document_field: str, **options: Any
    ) -> ScoreJob:
        """A rerank job: the query (field `query`) paired with each document in turn."""
        pairs = tuple((0, index) for index in range(len(documents)))
        return cls((query,), tuple(documents), pairs, "query", document_field, **options)

    @classmethod
    def of_items(
        cls,
        queries: tuple[str, ...],
        items: tuple[MediaItem, ...],
        fields: tuple[str, str],
        **options: Any,
    ) -> ScoreJob:
        """A job of multimodal documents: each document with its query (one query: all of
        them), a text document's text in `documents`."""
        pairs = tuple((0 if len(queries) == 1 else i, i) for i in range(len(items)))
        texts = tuple(item.text or "" for item in items)
        return cls(queries, texts, pairs, *fields, document_items=items, **options)


@dataclass(frozen=True)
class MediaItem:
    """One input of a request that may carry images: an image reference, a text, or a
    conversation of texts and images (vLLM's chat form, Cohere's content parts), which a
    vision-language model reads whole and a dual encoder only as one image or one text."""

    image: str | None = None  # a data URL, bare base64, or an http(s) URL (when allowed)
    text: str | None = None
    where: str = "input"  # where the body holds it, for error messages ("input[2]")
    # the conversation, its content parts kept: {"type": "text", "text": ...} and
    # {"type": "image_url", "image_url": {"url": ...}}
    chat: Chat | None = None
    image_wheres: tuple[str, ...] = ()  # where each image part of `chat` is in the body


@dataclass(frozen=True)
class MediaJob:
    """Images (and texts beside them) for a model that takes images: one prompt each (an
    image, a text, or a conversation holding images)."""

    task: PoolingTask
    items: tuple[MediaItem, ...]
    requested: Requested = field(default_factory=Requested)
    model: str | None = None
    truncate: Truncate = field(default_factory=Truncate)
    priority: int = 0


Job = TextJob | ScoreJob | MediaJob


def merge(task: PoolingTask, requested: Requested, defaults: PoolerDefaults) -> PoolingParams:
    """The request's value where set, else --pooler-config's where the task takes that field.

    Whatever is still None the model decides (its head, its sentence-transformers config).
    """
    merged = {
        name: value
        if value is not None or task not in FIELD_TASKS[name]
        else getattr(defaults, name)
        for name, value in ((f.name, getattr(requested, f.name)) for f in fields(requested))
    }
    return PoolingParams(task=task, **merged)
