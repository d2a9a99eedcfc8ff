"""Requests with images for a vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: a card with
`inline_images`): each image inside its prompt, where the chat template puts it.

A conversation is rendered by the model's chat template with its image parts kept, as
`{"type": "image"}` (vLLM's form of them; Qwen's templates write
`<|vision_start|><|image_pad|><|vision_end|>` for it), tokenized, and each placeholder the
template wrote repeated once per merged patch of its image, as transformers' Qwen2VLProcessor
expands it. A bare image (Cohere's `images`, Jina's and Infinity's image inputs) is a one-message
conversation of it; a text stays a text (`dual_item`: how a dual encoder, CLIP or SigLIP, reads
the same items instead). The rendered prompts' images are then placed as every template's
are (prompt_images.py): loaded through media.py (its limits and budgets), a prompt's length
known from the images' headers, so one too long is refused before any patch is cut, and
patches cut (grid_images.py) in worker threads.

A late-interaction retriever (ColQwen2: the card's `retrieval` forms) writes its prompts as its
processor does instead: a text as a query (`Query: ` + text + the pad token ten times + "\n"),
an image, bare or a conversation's one image_url part with no text, as its visual prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from poolserve.frontend.chat import ChatRender, check_request_chars, prepare, render
from poolserve.frontend.jobs import Chat, MediaItem, Truncate
from poolserve.frontend.media import Budgets, MediaLimits
from poolserve.frontend.prompt_images import (
    ImageRef,
    InlinePrompts,
    LengthBound,
    place_images,
)
from poolserve.frontend.state import ModelHandle
from poolserve.frontend.texts import (
    RawInputs,
    Truncation,
    run_budgeted,
    tokenize,
    truncation_for,
)
from poolserve.frontend.truncation import encode_batch
from poolserve.types.errors import InvalidRequestError
from poolserve.types.vision import InlineImages, PromptImages, RetrievalForms

# How a chat template sees an image part: vLLM's placeholder, which every Qwen-VL template
# (`content['type'] == 'image'`) writes as the image's placeholder run
IMAGE_PART: Mapping[str, str] = {"type": "image"}


@dataclass(frozen=True)
class Conversation:
    """One prompt with images, checked before any work: its render and its images in order."""

    render: ChatRender | None  # None: `text` is the prompt (a retriever's image document)
    images: tuple[ImageRef, ...]
    where: str  # the conversation in the body, for errors ("messages", "images[2]")
    text: str = ""

    @property
    def num_chars(self) -> int:
        """The characters it brings (the template's, or its fixed prompt's)."""
        return len(self.text) if self.render is None else self.render.num_chars


@dataclass(frozen=True)
class InlineRequest:
    """A request's prompts in order: texts (tokenized, and cut, as texts) and conversations."""

    prompts: tuple[str | Conversation, ...]
    num_chars: int  # the conversations' characters, bounded like a request's texts
    truncation: Truncation  # the texts'
    most_tokens: int  # a conversation's most tokens: max_model_len, or a cut the request asked


def image_refs(item: MediaItem) -> tuple[ImageRef, ...]:
    """Every image an item holds, in order, each with where the body holds it."""
    if item.image is not None:
        return (ImageRef(item.image, item.where),)
    if item.chat is None:
        return ()
    urls = [url for message in item.chat.messages for url in _part_urls(message)]
    wheres = item.image_wheres if len(item.image_wheres) == len(urls) else (item.where,) * len(urls)
    return tuple(ImageRef(url, where) for url, where in zip(urls, wheres, strict=True))


def _part_urls(message: Mapping[str, Any]) -> list[str]:
    """The URLs of a message's image_url parts."""
    content = message.get("content")
    if not isinstance(content, list | tuple):
        return []
    return [part["image_url"]["url"] for part in content if _is_image(part)]


def _is_image(part: object) -> bool:
    return isinstance(part, Mapping) and part.get("type") == "image_url"


def check_request(
    items: Sequence[MediaItem], model: ModelHandle, truncate: Truncate, trusted: bool
) -> InlineRequest:
    """Every prompt checked before any work: texts not empty; each conversation's template,
    options and size (chat.prepare), all of them within --max-request-chars. A conversation is
    never cut (its placeholders must match its images): a cut the request asks (not the
    model's own limit, -1) is the most tokens it may have. A retriever's image document is
    its one image alone, in the retriever's visual prompt."""
    prompts: list[str | Conversation] = []
    inline = model.card.inline_images
    retrieval = None if inline is None else inline.retrieval
    for item in items:
        if item.image is None and item.chat is None:
            if not item.text:
                raise InvalidRequestError(f"{item.where} is empty", item.where)
            prompts.append(item.text)
            continue
        if retrieval is not None:
            prompts.append(retrieval_document(item, retrieval))
            continue
        chat = item.chat or Chat(({"role": "user", "content": [IMAGE_PART]},))
        templated = Chat(
            tuple(_template_message(m) for m in chat.messages),
            chat.chat_template,
            chat.chat_template_kwargs,
            chat.add_generation_prompt,
            chat.continue_final_message,
        )
        prompts.append(
            Conversation(prepare(templated, model, trusted), image_refs(item), item.where)
        )
    num_chars = sum(p.num_chars for p in prompts if isinstance(p, Conversation))
    check_request_chars(num_chars, model)
    asked = truncate.tokens if truncate.tokens is not None and truncate.tokens > 0 else None
    most = model.max_model_len if asked is None else min(asked, model.max_model_len)
    return InlineRequest(tuple(prompts), num_chars, truncation_for(truncate, model), most)


def retrieval_document(item: MediaItem, forms: RetrievalForms) -> Conversation:
    """A retriever's image document: the item's one image in the visual prompt, as its
    processor writes an image (ColQwen2Processor takes an image alone: text beside it, or
    several images, is refused rather than dropped)."""
    refs = image_refs(item)
    texts = [] if item.chat is None else [t for m in item.chat.messages for t in _message_texts(m)]
    if len(refs) != 1 or texts:
        raise InvalidRequestError(
            f"{item.where}: this model embeds a document as one image alone (one image_url "
            "part, no text); send a text as a text",
            item.where.split("[")[0],
        )
    return Conversation(None, refs, item.where, forms.document)


def _template_message(message: Mapping[str, Any]) -> Mapping[str, Any]:
    """A message as the template reads it: each image_url part as the image placeholder (its
    URL, possibly megabytes of base64, is no business of the template's)."""
    content = message.get("content")
    if not isinstance(content, list | tuple):
        return message
    parts = [IMAGE_PART if _is_image(part) else part for part in content]
    return {**message, "content": parts}


async def inline_prompts(
    request: InlineRequest,
    model: ModelHandle,
    inline: InlineImages,
    limits: MediaLimits,
    budgets: Budgets,
    on_reject: Callable[[str], None],
) -> InlinePrompts:
    """Each prompt's token ids (a conversation's placeholders expanded) and its images, in the
    request's order: texts tokenized as texts, conversations rendered and tokenized, then their
    images placed (prompt_images.py: the checks before any patch is cut, the patch budget)."""
    conversations = [p for p in request.prompts if isinstance(p, Conversation)]
    texts = tuple(p for p in request.prompts if isinstance(p, str))
    if inline.retrieval is not None:  # a retriever's texts are its queries
        texts = tuple(inline.retrieval.query(text) for text in texts)
    text_ids = (
        await tokenize(RawInputs(texts, None), model, request.truncation, on_reject)
        if texts
        else []
    )
    rendered = await run_budgeted(
        model, request.num_chars, on_reject, _tokenized, model, conversations
    )
    bound = LengthBound(request.most_tokens, model.max_model_len)
    placed = await place_images(conversations, rendered, inline, bound, limits, budgets)
    prompts, ordered = _in_order(request.prompts, text_ids, placed.token_ids, placed.media)
    return InlinePrompts(prompts, ordered, placed.release)


def _in_order(
    prompts: Sequence[str | Conversation],
    text_ids: Sequence[list[int]],
    conversation_ids: Sequence[list[int]],
    media: Sequence[PromptImages | None],
) -> tuple[list[list[int]], list[PromptImages | None]]:
    """Texts' and conversations' prompts back in the request's order, with their images."""
    texts, conversations = iter(text_ids), iter(zip(conversation_ids, media, strict=True))
    ids: list[list[int]] = []
    images: list[PromptImages | None] = []
    for prompt in prompts:
        prompt_ids, prompt_images = (
            (next(texts), None) if isinstance(prompt, str) else next(conversations)
        )
        ids.append(prompt_ids)
        images.append(prompt_images)
    return ids, images


def _tokenized(model: ModelHandle, conversations: Sequence[Conversation]) -> list[list[int]]:
    """Each conversation rendered by the template and tokenized as it is (the template wrote
    the special tokens), in a worker thread."""
    texts = [
        c.text if c.render is None else render(model.tokenizer, c.render) for c in conversations
    ]
    return [list(tokens.ids) for tokens in encode_batch(model.tokenizer, texts)] if texts else []


def dual_item(item: MediaItem) -> MediaItem:
    """A conversation as a dual encoder embeds it (as vLLM serves CLIP and SigLIP): its one
    image alone, or its texts joined; both together are refused."""
    if item.chat is None:
        return item
    images = image_refs(item)
    messages = item.chat.messages
    texts = [text for m in messages for text in _message_texts(m)]
    if not images:
        return MediaItem(text="\n".join(texts), where=item.where)
    if len(images) > 1 or texts:
        raise InvalidRequestError(
            f"{item.where}: one image_url part, or text, per conversation: this model embeds "
            "an image or a text, not both together",
            item.where.split("[")[0],
        )
    return MediaItem(image=images[0].ref, where=images[0].where)


def _message_texts(message: Mapping[str, Any]) -> list[str]:
    """A message's text, as vLLM joins it for a model without parts: its string, or its
    text parts joined by newlines (none: a message of images alone)."""
    content = message.get("content")
    if isinstance(content, str):
        return [content] if content else []
    if not isinstance(content, list | tuple):
        return []
    parts = [str(p.get("text") or "") for p in content if p.get("type") == "text"]
    return ["\n".join(parts)] if parts else []
