"""vLLM's chat form of a pooling request: `messages` rendered into text by the chat template."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from poolserve.frontend.jobs import Chat
from poolserve.frontend.state import ModelHandle
from poolserve.frontend.texts import InputTooLongError, check_encodable, run_budgeted
from poolserve.types.errors import InvalidRequestError, PayloadTooLargeError, clip

logger = logging.getLogger(__name__)

# apply_chat_template's own parameters: a chat_template_kwargs key of one of these names would
# change how it renders (tokenize, truncate, return tensors) rather than feed the template.
RESERVED_KWARGS = frozenset(
    inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
) - {"self", "kwargs"}
# What a broken template or a conversation it refuses raises while rendering (jinja's
# raise_exception is a TemplateError; a template indexing what is not there raises the others).
RENDER_ERRORS = (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)


@dataclass(frozen=True)
class ChatRender:
    """Everything apply_chat_template gets for one conversation."""

    messages: tuple[Mapping[str, Any], ...]
    template: str | None  # None: the tokenizer's own (transformers picks among named ones)
    add_generation_prompt: bool
    continue_final_message: bool
    template_kwargs: Mapping[str, Any]
    num_chars: int  # characters of the conversation, bounded like a text input


def _num_chars(message: Mapping[str, Any]) -> int:
    """Characters a message brings to the template (role, content and other keys)."""
    return sum(
        len(value) if isinstance(value, str) else len(str(value)) for value in message.values()
    )


def _texts(message: Mapping[str, Any]) -> list[str]:
    """The texts a message's content brings: the string, or each text part's (a conversation
    of a vision-language model keeps its parts)."""
    content = message.get("content")
    if isinstance(content, list | tuple):
        return [str(p.get("text") or "") for p in content if isinstance(p, Mapping)]
    return [str(content or "")]


def prepare(chat: Chat, model: ModelHandle, trusted: bool) -> ChatRender:
    """Check a chat request before any work: template, trust, options and size."""
    kwargs = dict(chat.chat_template_kwargs or {})
    given = (
        chat.chat_template if chat.chat_template is not None else kwargs.pop("chat_template", None)
    )
    kwargs.pop("chat_template", None)
    if given is not None and not trusted:
        raise InvalidRequestError(
            "chat_template is refused: the server runs without --trust-request-chat-template",
            "chat_template",
        )
    if given is not None and not isinstance(given, str):
        raise InvalidRequestError("chat_template must be a string", "chat_template_kwargs")
    if given is None and not model.tokenizer.chat_template:
        raise InvalidRequestError(
            "this model has no chat template, so messages cannot be rendered; send input instead",
            "messages",
        )
    reserved = sorted(RESERVED_KWARGS & kwargs.keys())
    if reserved:
        logger.info("chat_template_kwargs: ignored %s (apply_chat_template's own)", reserved)
    messages = tuple(chat.messages or ())
    if not messages:
        raise InvalidRequestError("messages must not be empty", "messages")
    num_chars = sum(_num_chars(m) for m in messages)
    limit = model.limits.max_input_chars
    if num_chars > limit:
        raise InputTooLongError(
            f"messages have {num_chars} characters, more than the limit of {limit} "
            "(--max-input-chars)",
            "messages",
        )
    return ChatRender(
        messages=messages,
        template=given,
        add_generation_prompt=chat.add_generation_prompt,
        continue_final_message=chat.continue_final_message,
        template_kwargs={k: v for k, v in kwargs.items() if k not in RESERVED_KWARGS},
        num_chars=num_chars,
    )


def render(tokenizer: PreTrainedTokenizerBase, chat: ChatRender) -> str:
    """The conversation as the prompt text the template makes (400 when it refuses)."""
    check_encodable(["".join(_texts(m)) for m in chat.messages], "messages")
    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in chat.messages],
            chat_template=chat.template,
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
            tokenize=False,
            **chat.template_kwargs,
        )
    except RENDER_ERRORS as exc:
        raise InvalidRequestError(
            f"the chat template could not render messages: {clip(str(exc))}", "messages"
        ) from None
    if not isinstance(text, str) or not text:
        raise InvalidRequestError("the chat template rendered messages as nothing", "messages")
    return text


async def render_messages(
    chat: Chat, model: ModelHandle, trusted: bool, on_reject: Callable[[str], None]
) -> str:
    """The prompt text of a chat request, rendered in a worker thread within the char budget."""
    checked = prepare(chat, model, trusted)
    return await run_budgeted(model, checked.num_chars, on_reject, render, model.tokenizer, checked)


def check_request_chars(num_chars: int, model: ModelHandle) -> None:
    """413 for conversations of more characters than --max-request-chars, before any work."""
    if num_chars > model.limits.max_request_chars:
        raise PayloadTooLargeError(
            f"the conversations have {num_chars} characters, more than the limit of "
            f"{model.limits.max_request_chars} per request (--max-request-chars); split the "
            "request",
            "messages",
        )


async def render_conversations(
    chats: Sequence[Chat], model: ModelHandle, trusted: bool, on_reject: Callable[[str], None]
) -> list[str]:
    """Each conversation's prompt text, all checked first, rendered in one budgeted thread."""
    checked = [prepare(chat, model, trusted) for chat in chats]
    num_chars = sum(c.num_chars for c in checked)
    check_request_chars(num_chars, model)

    def render_all() -> list[str]:
        return [render(model.tokenizer, c) for c in checked]

    return await run_budgeted(model, num_chars, on_reject, render_all)
