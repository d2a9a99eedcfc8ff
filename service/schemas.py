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


class EmbeddingRequest(InputBody):
    """OpenAI `POST /v1/embeddings`."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    normalize: bool | None = None


class PoolingRequestBody(InputBody):
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
