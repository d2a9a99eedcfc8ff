"""Requests with images for a vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: a card with
`inline_images`): each image inside its prompt, where the chat template puts it.

A conversation is rendered by the model's chat template with its image parts kept, as
`{"type": "image"}` (vLLM's form of them; Qwen's templates write
`<|vision_start|><|image_pad|><|vision_end|>` for it), tokenized, and each placeholder the
template wrote repeated once per merged patch of its image, as transformers' Qwen2VLProcessor
expands it. A bare image (Cohere's `images`, Jina's and Infinity's image inputs) is a one-message
conversation of it; a text stays a text (`dual_item`: how a dual encoder, CLIP or SigLIP, reads
the same items instead). Images load through media.py (its limits and budgets)
and become patches (grid_images.py) in worker threads; a prompt's length is known from the
images' headers, so one too long is refused before any patch is cut.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from PIL import Image

from poolserve.frontend.chat import ChatRender, prepare, render
from poolserve.frontend.grid_images import grid_patches, image_grid
from poolserve.frontend.jobs import Chat, MediaItem, Truncate
from poolserve.frontend.media import Budgets, MediaLimits, load_image
from poolserve.frontend.state import ModelHandle
from poolserve.frontend.texts import (
    InputTooLongError,
    RawInputs,
    Truncation,
    run_budgeted,
    tokenize,
    truncation_for,
)
from poolserve.frontend.truncation import encode_batch
from poolserve.types.errors import InvalidRequestError, PayloadTooLargeError
from poolserve.types.vision import Grid, GridProcessing, InlineImages, PromptImages, image_digest

# How a chat template sees an image part: vLLM's placeholder, which every Qwen-VL template
# (`content['type'] == 'image'`) writes as the image's placeholder run
IMAGE_PART: Mapping[str, str] = {"type": "image"}


@dataclass(frozen=True)
class ImageRef:
    """One image of a prompt: its reference (data URL, base64, URL) and where the body holds it."""

    ref: str
    where: str


@dataclass(frozen=True)
class Conversation:
    """One prompt with images, checked before any work: its render and its images in order."""

    render: ChatRender
    images: tuple[ImageRef, ...]
    where: str  # the conversation in the body, for errors ("messages", "images[2]")


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
    model's own limit, -1) is the most tokens it may have."""
    prompts: list[str | Conversation] = []
    for item in items:
        if item.image is None and item.chat is None:
            if not item.text:
                raise InvalidRequestError(f"{item.where} is empty", item.where)
            prompts.append(item.text)
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
    num_chars = sum(p.render.num_chars for p in prompts if isinstance(p, Conversation))
    if num_chars > model.limits.max_request_chars:
        raise PayloadTooLargeError(
            f"the conversations have {num_chars} characters, more than the limit of "
            f"{model.limits.max_request_chars} per request (--max-request-chars); split the "
            "request",
            "messages",
        )
    asked = truncate.tokens if truncate.tokens is not None and truncate.tokens > 0 else None
    most = model.max_model_len if asked is None else min(asked, model.max_model_len)
    return InlineRequest(tuple(prompts), num_chars, truncation_for(truncate, model), most)


def _template_message(message: Mapping[str, Any]) -> Mapping[str, Any]:
    """A message as the template reads it: each image_url part as the image placeholder (its
    URL, possibly megabytes of base64, is no business of the template's)."""
    content = message.get("content")
    if not isinstance(content, list | tuple):
        return message
    parts = [IMAGE_PART if _is_image(part) else part for part in content]
    return {**message, "content": parts}


@dataclass(frozen=True)
class InlinePrompts:
    """A request's prompts with their images, and how to give back the patches' memory."""

    token_ids: list[list[int]]
    media: list[PromptImages | None]
    release: Callable[[], None]  # once the patches are sent (their budget's bytes given back)


def _patch_bytes(grids: Sequence[Grid], inline: InlineImages) -> int:
    """Bytes the images of these grids are as patches (float32)."""
    width = inline.processing.patch_width
    return sum(frames * rows * cols * width * 4 for frames, rows, cols in grids)


async def inline_prompts(
    request: InlineRequest,
    model: ModelHandle,
    inline: InlineImages,
    limits: MediaLimits,
    budgets: Budgets,
    on_reject: Callable[[str], None],
) -> InlinePrompts:
    """Each prompt's token ids (a conversation's placeholders expanded) and its images, in the
    request's order: the cheap checks (placeholders, then lengths from the images' sizes)
    before the patches are cut, under the process's patch budget."""
    conversations = [p for p in request.prompts if isinstance(p, Conversation)]
    texts = tuple(p for p in request.prompts if isinstance(p, str))
    text_ids = (
        await tokenize(RawInputs(texts, None), model, request.truncation, on_reject)
        if texts
        else []
    )
    rendered = await run_budgeted(
        model, request.num_chars, on_reject, _tokenized, model, conversations
    )
    for conversation, ids in zip(conversations, rendered, strict=True):
        _check_placeholders(conversation, ids, inline)
    loaded = await _load(conversations, limits, budgets)
    grids = [
        tuple(_grid(image, ref, inline) for image, ref in zip(images, c.images, strict=True))
        for c, images in zip(conversations, loaded, strict=True)
    ]
    for conversation, ids, grid in zip(conversations, rendered, grids, strict=True):
        length = _expanded_length(ids, grid, inline)
        _check_length(conversation, length, request.most_tokens, model.max_model_len)
    held = sum(_patch_bytes(grid, inline) for grid in grids)
    await budgets.patches.take(held)  # given back once sent (the Batch's release)
    try:
        media = await _patched(conversations, loaded, grids, inline)
    except BaseException:
        budgets.patches.give(held)
        raise
    expanded = [expand(ids, grid, inline) for ids, grid in zip(rendered, grids, strict=True)]
    prompts, ordered = _in_order(request.prompts, text_ids, expanded, media)
    return InlinePrompts(prompts, ordered, partial(budgets.patches.give, held))


async def _load(
    conversations: Sequence[Conversation], limits: MediaLimits, budgets: Budgets
) -> list[list[Image.Image]]:
    """Every conversation's images, decoded (media.py: its limits, budgets and threads)."""
    refs = [ref for c in conversations for ref in c.images]
    images = iter(
        await asyncio.gather(*(load_image(r.ref, limits, budgets, what=r.where) for r in refs))
    )
    return [[next(images) for _ in c.images] for c in conversations]


async def _patched(
    conversations: Sequence[Conversation],
    loaded: Sequence[Sequence[Image.Image]],
    grids: Sequence[tuple[Grid, ...]],
    inline: InlineImages,
) -> list[PromptImages | None]:
    """Each conversation's images as patches, each image in a worker thread (None: a
    conversation of text alone)."""
    steps = inline.processing
    work = [
        asyncio.to_thread(_cut, image, steps, ref.where)
        for c, images in zip(conversations, loaded, strict=True)
        for image, ref in zip(images, c.images, strict=True)
    ]
    cut = iter(await asyncio.gather(*work))
    media: list[PromptImages | None] = []
    for grid in grids:
        pieces = [next(cut) for _ in grid]
        arrays, digests = tuple(p for p, _ in pieces), tuple(d for _, d in pieces)
        media.append(PromptImages(arrays, grid, digests) if grid else None)
    return media


def _cut(image: Image.Image, steps: GridProcessing, where: str) -> tuple[np.ndarray, bytes]:
    """One image's patches and their digest, both in the worker thread (hashing an image's
    megabytes never runs on an event loop, the engine's included)."""
    patches, grid = grid_patches(image, steps, where)
    return patches, image_digest(patches, grid)


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
    texts = [render(model.tokenizer, c.render) for c in conversations]
    return [list(tokens.ids) for tokens in encode_batch(model.tokenizer, texts)] if texts else []


def _check_placeholders(
    conversation: Conversation, ids: Sequence[int], inline: InlineImages
) -> None:
    """One placeholder per image, each right after the token that opens an image (which the
    model's positions count images by): else 400, before any image is loaded."""
    token = inline.image_token_id
    found = [i for i, token_id in enumerate(ids) if token_id == token]
    count = len(conversation.images)
    if len(found) != count:
        raise InvalidRequestError(
            f"{conversation.where}: the chat template wrote {len(found)} image placeholders "
            f"({inline.image_token}) for {count} image{'s' if count != 1 else ''}; every image "
            "needs its one placeholder, and a text may not write one",
            conversation.where,
        )
    if any(i == 0 or ids[i - 1] != inline.vision_start_token_id for i in found):
        raise InvalidRequestError(
            f"{conversation.where}: an image placeholder ({inline.image_token}) the chat "
            "template did not open as an image; a text may not write one",
            conversation.where,
        )


def _grid(image: Image.Image, ref: ImageRef, inline: InlineImages) -> Grid:
    """The image's patch grid, from its size alone; 400 for one the processor refuses."""
    grid = image_grid(image.height, image.width, inline.processing, ref.where)
    try:
        inline.check_grid(grid)
    except ValueError as exc:
        raise InvalidRequestError(f"{ref.where}: {exc}", ref.where, "invalid_image") from None
    return grid


def _expanded_length(ids: Sequence[int], grids: Sequence[Grid], inline: InlineImages) -> int:
    """The prompt's length once each placeholder stands for its image's merged patches."""
    return len(ids) + sum(inline.num_tokens(grid) - 1 for grid in grids)


def _check_length(conversation: Conversation, length: int, keep: int, most: int) -> None:
    """400 for a prompt with images above max_model_len, or above a truncation the request
    asked: a prompt with images is never cut (its placeholders must match its images)."""
    if length <= keep:
        return
    said = "max_model_len" if keep == most else "the truncation asked (it never cuts images)"
    raise InputTooLongError(
        f"{conversation.where} has {length} tokens with its images, more than {keep} "
        f"({said}); send fewer or smaller images, or less text",
        conversation.where,
    )


def expand(ids: Sequence[int], grids: Sequence[Grid], inline: InlineImages) -> list[int]:
    """The token ids with the i-th image placeholder repeated once per merged patch of the
    i-th grid (Qwen2VLProcessor's expansion of `<|image_pad|>`)."""
    token = inline.image_token_id
    counts = iter(inline.num_tokens(grid) for grid in grids)
    expanded: list[int] = []
    for token_id in ids:
        if token_id == token:
            expanded.extend([token] * next(counts))
        else:
            expanded.append(token_id)
    return expanded


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
