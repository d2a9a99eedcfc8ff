"""Request bodies of every endpoint (pydantic lives only in service/)."""

from __future__ import annotations

import logging
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from poolserve.pooling.params import PoolingTask
from poolserve.service.errors import clip

logger = logging.getLogger(__name__)

# No vocabulary has more ids than int32 holds; bounding here keeps huge ids out of int64 arrays.
MAX_TOKEN_ID = 2**31 - 1
TokenId = Annotated[StrictInt, Field(ge=0, le=MAX_TOKEN_ID)]
TokenIds = list[TokenId]
# string | list of strings | token ids | list of token-id lists
Input = StrictStr | list[StrictStr] | TokenIds | list[TokenIds]


# Unknown fields named in one warning line at most; a body may carry thousands.
MAX_LOGGED_FIELDS = 8
# Fields vLLM's pooling requests define that have no meaning here: accepted, logged, not used.
IGNORED_FIELDS: dict[str, str] = {
    "padding": "prompts are packed without padding; no model here was trained on fixed lengths",
    "cache_salt": "the prefix cache serves last-token pooling only and is not salted per tenant",
    "mm_processor_kwargs": "no multimodal processor: text and token ids only",
    "media_io_kwargs": "no multimodal inputs",
}


class RequestBody(BaseModel):
    """Fields nobody defines are accepted and named in a warning, as vLLM does."""

    model_config = ConfigDict(extra="allow", frozen=True)

    @model_validator(mode="after")
    def _log_unused(self) -> Self:
        """One warning naming unknown fields; one info line naming vLLM's ignored ones."""
        extra = self.model_extra or {}
        if extra:
            names = ", ".join(clip(name, 64) for name in list(extra)[:MAX_LOGGED_FIELDS])
            more = len(extra) - MAX_LOGGED_FIELDS
            logger.warning(
                "%s: ignored unknown fields %s%s",
                type(self).__name__,
                names,
                f" (and {more} more)" if more > 0 else "",
            )
        ignored = [n for n in IGNORED_FIELDS if getattr(self, n, None) is not None]
        if ignored:
            logger.info(
                "%s: accepted and ignored %s",
                type(self).__name__,
                "; ".join(f"{n} ({IGNORED_FIELDS[n]})" for n in ignored),
            )
        return self


# vLLM's wire vocabulary for binary outputs (its serial_utils)
EncodingFormat = Literal["float", "base64", "bytes", "bytes_only"]
EmbedDType = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
Endianness = Literal["native", "big", "little"]
# What the x-request-id header may carry; a body's request_id is held to the same rule.
REQUEST_ID_PATTERN = r"^[A-Za-z0-9._-]{1,128}$"


class TextPart(BaseModel):
    """One text part of a chat message's content (OpenAI's content-part list)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    """One chat message; other keys (name, ...) are handed to the chat template as sent."""

    model_config = ConfigDict(extra="allow", frozen=True)

    role: StrictStr
    content: StrictStr | list[TextPart] | None = None


class InputBody(RequestBody):
    """Fields shared by every route that takes `input` (or, vLLM's chat form, `messages`)."""

    input: Input | None = None
    messages: list[ChatMessage] | None = Field(
        default=None, description="A chat conversation rendered with the model's chat template."
    )
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = Field(
        None, description="Keep only this many tokens (-1: the model's limit)."
    )
    truncation_side: Literal["left", "right"] | None = Field(
        None,
        description="Which end truncation keeps: right keeps the start (default: the "
        "tokenizer's own side, right for nearly every model).",
    )
    priority: StrictInt = 0
    add_special_tokens: bool | None = Field(
        default=None,
        description="Add the tokenizer's special tokens (default: true for input, false for "
        "messages, whose chat template adds its own).",
    )
    request_id: Annotated[str, Field(pattern=REQUEST_ID_PATTERN)] | None = Field(
        default=None, description="Echoed in the response id and x-request-id (header's wins)."
    )
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: StrictStr | None = Field(
        default=None, description="A Jinja chat template (needs --trust-request-chat-template)."
    )
    chat_template_kwargs: dict[str, object] | None = None
    padding: Literal["max_length", "do_not_pad"] | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    mm_processor_kwargs: dict[str, object] | None = None
    media_io_kwargs: dict[str, object] | None = None

    @model_validator(mode="after")
    def _one_prompt_form(self) -> Self:
        """Exactly one of input and messages; vLLM's chat-option conflict refused."""
        if (self.input is None) == (self.messages is None):
            raise ValueError("send exactly one of input and messages")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        return self


# ---- sentence-transformers prompts: extensions (vLLM defines neither field) -------------------
class PromptFields(BaseModel):
    """`prompt_name` (a key of the model's prompts) or a literal `prompt` to prepend."""

    # no `extra` of its own: a body mixing this in keeps its own unknown-field policy
    model_config = ConfigDict(frozen=True)

    prompt_name: StrictStr | None = Field(
        default=None, description="Prepend this prompt of config_sentence_transformers.json."
    )
    prompt: StrictStr | None = Field(
        default=None, description="Prepend this text (wins over prompt_name)."
    )


class EmbeddingRequest(InputBody, PromptFields):
    """OpenAI `POST /v1/embeddings` with vLLM's extra fields."""

    encoding_format: EncodingFormat = "float"
    embed_dtype: EmbedDType = "float32"
    endianness: Endianness = "native"
    dimensions: StrictInt | None = None
    normalize: bool | None = None
    use_activation: bool | None = Field(default=None, description="For embed: normalize (vLLM).")


class PoolingRequestBody(InputBody, PromptFields):
    """vLLM-compatible `POST /v1/pooling`."""

    task: PoolingTask | None = None
    encoding_format: EncodingFormat = "float"
    embed_dtype: EmbedDType = "float32"
    endianness: Endianness = "native"
    dimensions: StrictInt | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    step_tag_id: TokenId | None = None
    returned_token_ids: TokenIds | None = None
    stream: bool = False


class ClassifyRequest(InputBody):
    """`POST /v1/classify`."""

    use_activation: bool | None = None
    # vLLM's older names for use_activation, still sent by its clients
    softmax: bool | None = None
    activation: bool | None = None


class TokenizeRequest(RequestBody):
    """`POST /tokenize`."""

    prompt: StrictStr
    model: str | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(RequestBody):
    """`POST /detokenize`."""

    tokens: TokenIds
    model: str | None = None


# ---- retrieval: /score, /rerank (their shapes are read from the peers' protocol code) ----------
Texts = StrictStr | list[StrictStr]


class _ScoringBody(RequestBody):
    """Fields shared by the vLLM-style scoring routes."""

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = Field(
        None,
        description="Keep only this many tokens of each prompt (-1: the model's limit), cutting "
        "the document before the query.",
    )
    truncation_side: Literal["left", "right"] | None = Field(
        None, description="Which end of a text truncation cuts (default: the tokenizer's)."
    )
    use_activation: bool | None = Field(
        None,
        description="false: the raw logit instead of the model's activation (cross-encoders).",
    )
    priority: StrictInt = 0


class ScoreRequestBody(_ScoringBody):
    """vLLM `POST /score`: each text_1 with its text_2 (1:1, 1:N or N:N)."""

    text_1: Texts
    text_2: Texts


class RerankRequestBody(_ScoringBody):
    """`POST /rerank`, `/v1/rerank`, `/v2/rerank`: vLLM's, Jina's and Cohere's rerank body."""

    query: StrictStr
    documents: list[StrictStr]
    top_n: Annotated[StrictInt, Field(ge=1)] | None = Field(
        None, description="Return only the best top_n results (default: all)."
    )
    return_documents: bool = Field(True, description="Include each document's text.")
    max_tokens_per_doc: Annotated[StrictInt, Field(ge=1)] | None = Field(
        None, description="Cohere: cut each document to this many tokens."
    )
    relevant_spans: dict[str, object] | None = Field(
        None, description="Cohere: accepted and ignored (no spans are returned)."
    )


class TEIRerankRequest(RequestBody):
    """text-embeddings-inference `POST /rerank` (told apart from the others by `texts`)."""

    query: StrictStr
    texts: list[StrictStr]
    truncate: bool | None = Field(None, description="Cut long pairs to the model's limit.")
    # TEI's enum deserializes its variant names, Left and Right; its docs write them lower case
    truncation_direction: Literal["Left", "Right", "left", "right"] = "Right"
    raw_scores: bool = Field(False, description="The raw logit instead of the sigmoid.")
    return_text: bool = Field(False, description="Include each text.")
