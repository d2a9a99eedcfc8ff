"""What every request body shares, native or compat: strict fields, unknown ones logged."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationInfo,
    model_validator,
)

from poolserve.types.errors import InvalidRequestError, clip

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


# FlagEmbedding's weights of bge-m3's scores: honoured by vLLM's scoring bodies (api/schemas.py),
# refused by the other rerank bodies rather than dropped (the scores would be the dense ones).
MODE_WEIGHTS_FOREIGN: dict[str, str] = {
    "weights_for_different_modes": "FlagEmbedding's (bge-m3) and not honoured with this body: "
    "send it with vLLM's body (query, documents) on POST /rerank, or on POST /score",
}


# The validation context of a body tried against several shapes: no lines are logged for it.
QUIET: dict[str, bool] = {"quiet": True}


class RequestBody(BaseModel):
    """Fields nobody defines are accepted and named in a warning, as vLLM does; a field another
    API defines that would change the answer, and that this body does not honour, is refused."""

    model_config = ConfigDict(extra="allow", frozen=True)

    # another API's field -> whose it is and what this body takes instead: dropping it would
    # answer something else than the client asked for, silently (a 400 names it instead)
    foreign_fields: ClassVar[Mapping[str, str]] = {}

    @model_validator(mode="after")
    def _log_unused(self, info: ValidationInfo) -> Self:
        """A foreign field refused; one warning naming unknown fields; one info line naming
        vLLM's ignored ones (none when validated with the QUIET context: a body tried against
        several shapes, which then fails this shape instead of answering)."""
        extra = self.model_extra or {}
        foreign = next(
            (n for n, v in extra.items() if n in self.foreign_fields and v is not None), None
        )
        if foreign is not None:
            message = f"{foreign} is {self.foreign_fields[foreign]}"
            if info.context is QUIET:
                raise ValueError(message)
            raise InvalidRequestError(message, foreign)
        if info.context is QUIET:
            return self
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


# What the x-request-id header may carry; a body's request_id is held to the same rule.
REQUEST_ID_PATTERN = r"^[A-Za-z0-9._-]{1,128}$"


class TextPart(BaseModel):
    """One text part of a chat message's content (OpenAI's content-part list)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: Literal["text"]
    text: StrictStr


class ImageUrl(BaseModel):
    """OpenAI's `image_url` object: a data URL (base64) or an http(s) URL."""

    model_config = ConfigDict(extra="allow", frozen=True)

    url: StrictStr
    detail: StrictStr | None = None  # OpenAI's; a pooling model's processor decides the size


class ImageUrlPart(BaseModel):
    """One image part of a chat message's content (OpenAI's `image_url` content part)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImageUrlPart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    """One chat message; other keys (name, ...) are handed to the chat template as sent."""

    model_config = ConfigDict(extra="allow", frozen=True)

    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None

    def images(self) -> list[str]:
        """The URLs of its image parts."""
        if not isinstance(self.content, list):
            return []
        return [p.image_url.url for p in self.content if isinstance(p, ImageUrlPart)]

    def text(self) -> str | None:
        """Its text: the string, or its text parts joined by newlines."""
        if not isinstance(self.content, list):
            return self.content
        return "\n".join(p.text for p in self.content if isinstance(p, TextPart))

    def has_text(self) -> bool:
        """Whether it carries any text (a string, or a text part)."""
        if not isinstance(self.content, list):
            return bool(self.content)
        return any(isinstance(p, TextPart) for p in self.content)


def as_template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it: text parts joined by newlines, as vLLM does."""
    fields = dict(message.model_extra or {})
    return {**fields, "role": message.role, "content": message.text()}
