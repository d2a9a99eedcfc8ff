"""Request bodies of every endpoint (pydantic lives only in service/)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from pooling.params import PoolingTask

# No vocabulary has more ids than int32 holds; bounding here keeps huge ids out of int64 arrays.
MAX_TOKEN_ID = 2**31 - 1
TokenId = Annotated[StrictInt, Field(ge=0, le=MAX_TOKEN_ID)]
TokenIds = list[TokenId]
# string | list of strings | token ids | list of token-id lists
Input = StrictStr | list[StrictStr] | TokenIds | list[TokenIds]


class _Body(BaseModel):
    """Unknown fields are refused, so a typo is a 400 rather than a silent default."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class InputBody(_Body):
    """Fields shared by every route that takes `input`."""

    input: Input
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
    """OpenAI `POST /v1/embeddings`."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    normalize: bool | None = None


class PoolingRequestBody(InputBody, PromptFields):
    """vLLM-compatible `POST /v1/pooling`."""

    task: PoolingTask | None = None
    encoding_format: Literal["float", "base64"] = "float"
    embed_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    dimensions: StrictInt | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    step_tag_id: TokenId | None = None
    returned_token_ids: TokenIds | None = None
    stream: bool = False


class ClassifyRequest(InputBody):
    """`POST /v1/classify`."""

    use_activation: bool | None = None


class TokenizeRequest(_Body):
    """`POST /tokenize`."""

    prompt: StrictStr
    model: str | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    """`POST /detokenize`."""

    tokens: TokenIds
    model: str | None = None


# ---- retrieval: /score, /rerank (their shapes are read from the peers' protocol code) ----------
Texts = StrictStr | list[StrictStr]


class _ScoringBody(_Body):
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


class TEIRerankRequest(_Body):
    """text-embeddings-inference `POST /rerank` (told apart from the others by `texts`)."""

    query: StrictStr
    texts: list[StrictStr]
    truncate: bool | None = Field(None, description="Cut long pairs to the model's limit.")
    # TEI's enum deserializes its variant names, Left and Right; its docs write them lower case
    truncation_direction: Literal["Left", "Right", "left", "right"] = "Right"
    raw_scores: bool = Field(False, description="The raw logit instead of the sigmoid.")
    return_text: bool = Field(False, description="Include each text.")
