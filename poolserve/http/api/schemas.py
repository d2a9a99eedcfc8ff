"""Request bodies of the native routes: OpenAI's and vLLM's (pydantic lives only in service/)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal, Self, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    WithJsonSchema,
    model_validator,
)
from pydantic.json_schema import JsonDict

from poolserve.frontend.jobs import Chat, MediaItem, MediaJob, Requested, TextJob, Truncate
from poolserve.frontend.spans import LateChunking
from poolserve.http.api.embedding_fields import ClientEmbeddingFields
from poolserve.http.bodies import (
    REQUEST_ID_PATTERN,
    ChatMessage,
    ContentPart,
    ImageUrlPart,
    Input,
    RequestBody,
    TokenId,
    TokenIds,
    as_template_message,
)
from poolserve.types.tasks import PUBLIC_TASKS, PoolingTask

# The tasks a client may name (an internal one is refused as a task the model lacks): the
# schema lists only these.
PublicTask = Annotated[
    PoolingTask,
    WithJsonSchema({"type": "string", "enum": [t.value for t in PoolingTask if t in PUBLIC_TASKS]}),
]

# vLLM's wire vocabulary for binary outputs (its serial_utils)
EncodingFormat = Literal["float", "base64", "bytes", "bytes_only"]
EmbedDType = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
Endianness = Literal["native", "big", "little"]


# Other APIs' fields that change the answer, refused where the body does not honour them
# (RequestBody.foreign_fields): whose each is, and what to send here instead.
COHERE_TEI_FOREIGN: dict[str, str] = {
    "embedding_types": "Cohere's (POST /v2/embed) and not honoured here: send output_dtype "
    "(POST /v1/embeddings)",
    "max_tokens": "Cohere's (POST /v2/embed) and not honoured here: send truncate_prompt_tokens",
    "truncation_direction": "TEI's and not honoured here: send truncation_side",
}
EMBEDDING_CLIENTS_FOREIGN: dict[str, str] = {
    "input_type": "Voyage's and NIM's, honoured on POST /v1/embeddings: send prompt_name here",
    "output_dtype": "Voyage's, honoured on POST /v1/embeddings, not here",
    "embedding_type": "Jina's and NIM's, honoured on POST /v1/embeddings, not here",
    "output_dimension": "Voyage's and not honoured here: send dimensions",
    "normalized": "Jina's and not honoured here: send normalize",
    "truncate": "NIM's and Jina's and not honoured here: send truncate_prompt_tokens",
    "truncation": "Voyage's and not honoured here: send truncate_prompt_tokens",
}


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
            # vLLM's message, word for word: its clients and tests match on it
            raise ValueError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        return self

    def conversations(self) -> tuple[tuple[ChatMessage, ...], ...] | None:
        """The body's chat conversations (one here; /v1/embeddings also takes a batch)."""
        return None if self.messages is None else (tuple(self.messages),)

    def conversation_where(self, index: int) -> str:
        """Where conversation `index` is in the body: `messages` (a batch: `messages[i]`)."""
        return "messages"

    def _chat_item(self, conversation: Sequence[ChatMessage], index: int) -> MediaItem:
        """One conversation of a request with images, its content parts kept: a
        vision-language model reads it whole, a dual encoder its one image or its text."""
        where = self.conversation_where(index)
        chat = Chat(
            tuple(_with_parts(m) for m in conversation),
            self.chat_template,
            self.chat_template_kwargs,
            self.add_generation_prompt,
            self.continue_final_message,
        )
        return MediaItem(where=where, chat=chat, image_wheres=_image_wheres(conversation, where))

    def job(self, task: PoolingTask, requested: Requested | None = None) -> TextJob | MediaJob:
        """The front end's job for this body (a media job when an input holds an image)."""
        items = _jina_items(self.input)
        if items is not None and any(item.image is not None for item in items):
            return MediaJob(
                task,
                items,
                requested or Requested(),
                self.model,
                Truncate(self.truncate_prompt_tokens, self.truncation_side),
                self.priority,
            )
        conversations = self.conversations()
        if conversations is not None and any(m.images() for c in conversations for m in c):
            return MediaJob(
                task,
                tuple(self._chat_item(c, i) for i, c in enumerate(conversations)),
                requested or Requested(),
                self.model,
                Truncate(self.truncate_prompt_tokens, self.truncation_side),
                self.priority,
            )
        chats = None
        if conversations is not None:
            chats = tuple(
                Chat(
                    tuple(as_template_message(m) for m in messages),
                    self.chat_template,
                    self.chat_template_kwargs,
                    self.add_generation_prompt,
                    self.continue_final_message,
                )
                for messages in conversations
            )
        prompts = (
            (self.prompt_name, self.prompt) if isinstance(self, PromptFields) else (None, None)
        )
        late = self.late_chunking if isinstance(self, LateChunkingFields) else None
        return TextJob(
            task,
            self.input if items is None else [item.text for item in items],
            chats,
            requested or Requested(),
            self.model,
            *prompts,
            Truncate(self.truncate_prompt_tokens, self.truncation_side),
            self.add_special_tokens,
            self.priority,
            _late_job(late),
        )


class JinaInput(BaseModel):
    """Jina's multimodal input item: `{"text": ...}` or `{"image": URL or base64}`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: StrictStr | None = None
    image: StrictStr | None = None

    @model_validator(mode="after")
    def _one_of(self) -> Self:
        """Exactly one of text and image."""
        if (self.text is None) == (self.image is None):
            raise ValueError("each input object holds exactly one of text and image")
        return self


def _jina_items(value: object) -> tuple[MediaItem, ...] | None:
    """Jina's input objects as the job's items; None: `input` holds no objects."""
    if not (isinstance(value, list) and value and isinstance(value[0], JinaInput)):
        return None
    return tuple(
        MediaItem(image=item.image, text=item.text, where=f"input[{i}]")
        for i, item in enumerate(cast(list[JinaInput], value))
    )


def _with_parts(message: ChatMessage) -> dict[str, Any]:
    """A message with its content parts kept (a conversation holding images): text parts and
    image_url parts as OpenAI's clients send them."""
    fields = dict(message.model_extra or {})
    content = message.content
    if isinstance(content, list):
        parts: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": p.image_url.url}}
            if isinstance(p, ImageUrlPart)
            else {"type": "text", "text": p.text}
            for p in content
        ]
        return {**fields, "role": message.role, "content": parts}
    return {**fields, "role": message.role, "content": content}


def _image_wheres(conversation: Sequence[ChatMessage], where: str) -> tuple[str, ...]:
    """Where each image part of a conversation is in the body (`messages[0].content[1]`)."""
    return tuple(
        f"{where}[{j}].content[{k}]"
        for j, message in enumerate(conversation)
        if isinstance(message.content, list)
        for k, part in enumerate(message.content)
        if isinstance(part, ImageUrlPart)
    )


# ---- late chunking: an extension (no peer serves it as a released API) -------------------------
CharSpan = tuple[StrictInt, StrictInt]


class LateChunkingBody(BaseModel):
    """`late_chunking`: exactly one of `spans` (per input, character ranges) and `chunk_size`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    spans: list[list[CharSpan]] | None = Field(
        default=None,
        description="One list per input of character ranges [start, end) of that input's text; "
        "each becomes one embedding.",
    )
    chunk_size: Annotated[StrictInt, Field(gt=0)] | None = Field(
        default=None,
        description="Cut each input into consecutive windows of this many tokens of its own "
        "(special tokens excluded); each window becomes one embedding.",
    )

    @model_validator(mode="after")
    def _one_form(self) -> Self:
        """Exactly one of spans and chunk_size."""
        if (self.spans is None) == (self.chunk_size is None):
            raise ValueError("late_chunking takes exactly one of spans and chunk_size")
        return self

    def job(self) -> LateChunking:
        """The front end's late-chunking record."""
        if self.spans is None:
            return LateChunking(chunk_size=self.chunk_size)
        return LateChunking(spans=tuple(tuple(ranges) for ranges in self.spans))


def _late_job(late: LateChunkingBody | bool | None) -> LateChunking | None:
    """The job's late chunking: Jina's `true` joins the inputs into one document
    (frontend/joined.py), its `false` asks for none; the object names spans or windows."""
    if isinstance(late, bool):
        return LateChunking(joined=True) if late else None
    return None if late is None else late.job()


class LateChunkingFields(BaseModel):
    """`late_chunking`: one forward over each whole input, one embedding per span of it."""

    # no `extra` of its own: a body mixing this in keeps its own unknown-field policy
    model_config = ConfigDict(frozen=True)

    late_chunking: LateChunkingBody | None = Field(
        default=None,
        description="Late chunking: each text runs through the model whole and each span (or "
        "window of chunk_size tokens) is pooled from its contextual token states; one item per "
        "span, with input_index and span.",
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


Conversations = list[ChatMessage] | list[Annotated[list[ChatMessage], Field(min_length=1)]]


def _is_conversation(value: object) -> bool:
    """A non-empty list of chat messages (objects with a string `role`), as vLLM tells them."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)
    )


class EmbeddingRequest(InputBody, PromptFields, LateChunkingFields, ClientEmbeddingFields):
    """OpenAI `POST /v1/embeddings` with vLLM's extra fields (and Voyage's, NIM's, Jina's).

    As vLLM 0.33: `messages` may be one conversation or a batch of them, and `input` may carry
    either (then read as `messages`).
    """

    # wider than InputBody's: Jina's text and image objects
    input: Input | list[JinaInput] | None = None  # type: ignore[assignment]
    # wider than InputBody's: a batch of conversations too (vLLM 0.33's /v1/embeddings only)
    messages: Conversations | None = Field(  # type: ignore[assignment]
        default=None,
        description="A chat conversation, or a batch of them, rendered with the model's chat "
        "template (one embedding per conversation).",
    )

    @model_validator(mode="before")
    @classmethod
    def _chat_in_input(cls, data: object) -> object:
        """Chat conversations sent as `input` are vLLM's chat form."""
        if not isinstance(data, dict) or "messages" in data or "input" not in data:
            return data
        value = data["input"]
        single = _is_conversation(value)
        batch = isinstance(value, list) and bool(value) and all(map(_is_conversation, value))
        if not (single or batch):
            return data
        moved = dict(data)
        moved["messages"] = moved.pop("input")
        return moved

    def conversations(self) -> tuple[tuple[ChatMessage, ...], ...] | None:
        """One conversation, or each of a batch."""
        messages = self.messages
        if messages is None:
            return None
        # the schema admits a list of messages or a list of such lists, never a mix
        if messages and isinstance(messages[0], list):
            return tuple(tuple(c) for c in cast(list[list[ChatMessage]], messages))
        # an empty list is one empty conversation, refused as such when it is checked
        return (tuple(cast(list[ChatMessage], messages)),)

    def conversation_where(self, index: int) -> str:
        """`messages[i]` in a batch of conversations, `messages` for one."""
        messages = self.messages
        batch = messages is not None and bool(messages) and isinstance(messages[0], list)
        return f"messages[{index}]" if batch else "messages"

    foreign_fields = COHERE_TEI_FOREIGN

    # wider than LateChunkingFields': Jina's boolean, its inputs joined into one document
    late_chunking: LateChunkingBody | StrictBool | None = Field(  # type: ignore[assignment]
        default=None,
        description="Jina: true embeds the inputs joined by a space in one pass, each input the "
        "mean of its own tokens' states (one item per input); or this server's object: spans "
        "or chunk_size per input (one item per span).",
    )
    encoding_format: EncodingFormat = "float"
    embed_dtype: EmbedDType = "float32"
    endianness: Endianness = "native"
    dimensions: StrictInt | None = None
    normalize: bool | None = None
    use_activation: bool | None = Field(default=None, description="For embed: normalize (vLLM).")
    # Jina's embeddings API: the task adapter (jina-embeddings-v3's LoRA) and its instruction
    task: StrictStr | None = Field(
        default=None, description="The model's task adapter to run (Jina: retrieval.query, ...)."
    )


class PoolingRequestBody(InputBody, PromptFields, LateChunkingFields):
    """vLLM-compatible `POST /v1/pooling`."""

    foreign_fields = {**COHERE_TEI_FOREIGN, **EMBEDDING_CLIENTS_FOREIGN}
    task: PublicTask | None = None
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

    foreign_fields = COHERE_TEI_FOREIGN
    use_activation: bool | None = None
    # vLLM's older names for use_activation, still sent by its clients
    softmax: bool | None = None
    activation: bool | None = None


# `/tokenize`'s schema is inlined by service/dispatch.py, where a nested model's $ref would not
# resolve: its messages are described flat. Exactly one of prompt and messages.
_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]}
_MESSAGES_SCHEMA = {
    "anyOf": [
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"role": {"type": "string"}, "content": _CONTENT},
                "required": ["role"],
            },
        },
        {"type": "null"},
    ],
    "default": None,
}
_ONE_FORM: JsonDict = {"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]}


class TokenizeRequest(RequestBody):
    """vLLM's `POST /tokenize`: a `prompt`, or its chat form: `messages` and chat options."""

    model_config = ConfigDict(json_schema_extra=_ONE_FORM)

    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage] | None, WithJsonSchema(_MESSAGES_SCHEMA)] = None
    model: str | None = None
    add_special_tokens: bool | None = Field(
        default=None,
        description="Add the tokenizer's special tokens (default: true for prompt, false for "
        "messages, whose chat template adds its own).",
    )
    return_token_strs: bool | None = Field(
        default=False, description="Also return each token's string (`token_strs`)."
    )
    # vLLM's chat fields; on /tokenize the generation prompt is added unless asked not to
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: StrictStr | None = Field(
        default=None, description="A Jinja chat template (needs --trust-request-chat-template)."
    )
    chat_template_kwargs: dict[str, object] | None = None
    tools: list[dict[str, object]] | None = Field(
        default=None, description="Refused unless empty: tools are not rendered here."
    )
    media_io_kwargs: dict[str, object] | None = None
    mm_processor_kwargs: dict[str, object] | None = None

    @model_validator(mode="after")
    def _one_prompt_form(self) -> Self:
        """Exactly one of prompt and messages; the chat options that cannot render refused."""
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        if self.messages is not None and self.add_generation_prompt and self.continue_final_message:
            raise ValueError(
                "add_generation_prompt (default true on /tokenize) and continue_final_message "
                "cannot both be true"
            )
        if self.tools:
            raise ValueError("tools are not supported: chat templates are rendered without tools")
        return self

    def chat(self) -> Chat | None:
        """The chat form as the front end renders it (None for a prompt)."""
        if self.messages is None:
            return None
        return Chat(
            tuple(as_template_message(m) for m in self.messages),
            self.chat_template,
            self.chat_template_kwargs,
            self.add_generation_prompt,
            self.continue_final_message,
        )


class DetokenizeRequest(RequestBody):
    """`POST /detokenize`."""

    tokens: TokenIds
    model: str | None = None


# ---- retrieval: /score, /rerank (their shapes are read from the peers' protocol code) ----------
Texts = StrictStr | list[StrictStr]
NonNegative = Annotated[StrictInt, Field(ge=0)]
# FlagEmbedding's weights_for_different_modes: dense, sparse, ColBERT (their sum is checked with
# the model, types/scoring.py)
ModeWeights = Annotated[
    list[Annotated[StrictFloat, Field(ge=0, allow_inf_nan=False)]],
    Field(min_length=3, max_length=3),
]
# vLLM's score bodies, in the order its request union tries them: the first form whose two fields
# are both present wins (the other forms' fields are then ignored, as vLLM ignores extra fields).
SCORE_FORMS: tuple[tuple[str, str], ...] = (
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
    ("text_1", "text_2"),
)


class _ScoringBody(RequestBody):
    """Fields shared by the vLLM-style scoring routes (vLLM's ScoringRequestMixin)."""

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
    max_tokens_per_doc: StrictInt | None = Field(
        None,
        description="Cut each document to its first this many tokens, a positive integer "
        "(default: no cut; Cohere's 4096 on /v2/rerank).",
    )
    max_tokens_per_query: NonNegative = Field(
        0, description="vLLM's cut of each query (0: none); other values are refused here."
    )
    instruction: StrictStr | None = Field(
        None,
        description="The task instruction of the model's score template (Qwen3-Reranker's "
        "<Instruct>, mxbai-rerank-v2's instruction line, bge-reranker-v2-gemma's prompt); "
        "default: the model card's. Ignored by a model without an instruction slot, as vLLM.",
    )
    chat_template_kwargs: dict[str, object] | None = Field(
        None, description="Further variables of the score template (vLLM's)."
    )
    request_id: Annotated[str, Field(pattern=REQUEST_ID_PATTERN)] | None = Field(
        default=None, description="Echoed in the response id and x-request-id (header's wins)."
    )
    weights_for_different_modes: ModeWeights | None = Field(
        None,
        description="bge-m3 only: FlagEmbedding's compute_score weights of its dense, sparse "
        "and ColBERT scores; each pair's score is then their weighted sum over the weights' sum "
        "('colbert+sparse+dense'), from one forward per text (default: the dense cosine).",
    )
    padding: Literal["max_length", "do_not_pad"] | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    mm_processor_kwargs: dict[str, object] | None = None


class MultiModalDocuments(BaseModel):
    """vLLM's multimodal side of a pair (`ScoreMultiModalParam`): each content part is one
    document, a text or an image (`image_url`), for a model that takes images."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    content: Annotated[list[ContentPart], Field(min_length=1)]


# A side of a scoring request: texts, or vLLM's multimodal content parts
Documents = Texts | MultiModalDocuments


class ScoreRequestBody(_ScoringBody):
    """vLLM `POST /score`: queries with documents (or items, data_2, text_2): 1:1, 1:N or N:N."""

    queries: Texts | None = None
    documents: Documents | None = None
    items: Documents | None = None
    data_1: Texts | None = None
    data_2: Documents | None = None
    text_1: Texts | None = None
    text_2: Documents | None = None

    @model_validator(mode="after")
    def _one_form(self) -> Self:
        """One of vLLM's four forms must be complete."""
        if self.form is None:
            raise ValueError(
                "send queries and documents (or queries and items, data_1 and data_2, "
                "text_1 and text_2)"
            )
        return self

    @property
    def form(self) -> tuple[str, str] | None:
        """The field names of the pair form this body uses (vLLM's precedence)."""
        return next(
            (f for f in SCORE_FORMS if all(getattr(self, name) is not None for name in f)), None
        )


class RerankRequestBody(_ScoringBody):
    """`POST /rerank`, `/v1/rerank`, `/v2/rerank`: vLLM's, Jina's and Cohere's rerank body."""

    query: StrictStr
    documents: Documents
    top_n: NonNegative | None = Field(
        0, description="Return only the best top_n results (0 or null: all, as vLLM's default)."
    )
    return_documents: bool = Field(True, description="Include each document's text.")
    relevant_spans: dict[str, object] | None = Field(
        None, description="Cohere: accepted and ignored (no spans are returned)."
    )
