"""Request bodies of the native routes: OpenAI's and vLLM's (pydantic lives only in service/)."""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from poolserve.pooling.params import PoolingTask
from poolserve.service.frontend.bodies import (
    REQUEST_ID_PATTERN,
    ChatMessage,
    Input,
    RequestBody,
    TokenId,
    TokenIds,
)
from poolserve.service.frontend.jobs import Chat, Requested, TextJob, Truncate

# vLLM's wire vocabulary for binary outputs (its serial_utils)
EncodingFormat = Literal["float", "base64", "bytes", "bytes_only"]
EmbedDType = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
Endianness = Literal["native", "big", "little"]


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

    def job(self, task: PoolingTask, requested: Requested | None = None) -> TextJob:
        """The front end's job for this body."""
        chat = None
        if self.messages is not None:
            chat = Chat(
                tuple(self.messages),
                self.chat_template,
                self.chat_template_kwargs,
                self.add_generation_prompt,
                self.continue_final_message,
            )
        prompts = (
            (self.prompt_name, self.prompt) if isinstance(self, PromptFields) else (None, None)
        )
        return TextJob(
            task,
            self.input,
            chat,
            requested or Requested(),
            self.model,
            *prompts,
            Truncate(self.truncate_prompt_tokens, self.truncation_side),
            self.add_special_tokens,
            self.priority,
        )


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
