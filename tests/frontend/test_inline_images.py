"""Requests with images for a vision-language model (a card with `inline_images`): the prompts
the front end submits equal transformers' own `Qwen2VLProcessor(images=..., text=rendered)`
(input_ids with each `<|image_pad|>` expanded, pixel_values and image_grid_thw, bit for bit)
for vLLM's chat form on /v1/embeddings and /v1/pooling (one conversation, a batch, texts and
images mixed), Cohere's images and inputs (text and image content as one conversation), Jina's
input objects and Infinity's modality image (each bare image a one-message conversation; texts
stay texts); and what cannot be served is a 400 before any engine work: a template's
placeholders that do not match the images, a prompt too long for max_model_len or for the
truncation asked, a lopsided image, too many images, and any image sent to a text-only model.

The app runs in process on the embedded MiniLM with its engine's `submit_many` replaced by a
recorder, and its model handle given the tiny Qwen-VL checkpoint's tokenizer, chat template and
image processor (tests/tiny_vl.py): the engine side of these models is tested against a live
engine elsewhere.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import transformers
from PIL import Image
from starlette.testclient import TestClient
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from poolserve.config.settings import ServerSettings
from poolserve.frontend.prompt_images import expand
from poolserve.frontend.state import ModelHandle, Served, ServiceState, SpecialTokens
from poolserve.http.app import create_app
from poolserve.types.errors import InvalidRequestError
from poolserve.types.outputs import PoolingOutput
from poolserve.types.vision import InlineImages, PromptImages, image_digest, read_grid_processing
from tests.tiny_vl import CHAT_TEMPLATE, FAMILIES, IMAGE_TOKEN, START_TOKEN, save_tiny_vl

NAME = "vl"
MAX_IMAGES = 4
TEXT = "w1 w2 w3"


def picture(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """A random image."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 4), dtype=np.uint8)
    return Image.fromarray(pixels, "RGBA").convert(mode)


def data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def decoded(url: str) -> Image.Image:
    """The image a data URL holds, as PIL opens it (the processor converts it to RGB)."""
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


PICTURES = [
    data_url(picture(60, 40, 0)),
    data_url(picture(33, 97, 1, "RGBA")),
    data_url(picture(150, 150, 2)),  # ~90,000 characters of base64: above --max-input-chars
    data_url(picture(23, 17, 3, "L")),
]


class ImageTextProcessor(transformers.Qwen2VLProcessor):
    """transformers' Qwen2VLProcessor without a video processor (that needs torchvision)."""

    def check_argument_for_proper_class(self, name: str, arg: Any) -> Any:
        if arg is not None:
            return super().check_argument_for_proper_class(name, arg)
        return None


@dataclass
class Recorded:
    """What the engine was handed: each submission's prompts and images."""

    prompts: list[list[int]] = field(default_factory=list)
    media: list[PromptImages | None] = field(default_factory=list)
    calls: int = 0


@dataclass
class VL:
    """The app, the VL model's handle, the text-only one, the reference processor."""

    client: TestClient
    state: ServiceState
    vl: ModelHandle
    text_only: ModelHandle
    processor: ImageTextProcessor
    recorded: Recorded

    def serve(self, handle: ModelHandle) -> None:
        served = Served(handle, self.state.models[0].engine)
        self.state.serve((served,), served)

    def post(self, path: str, body: dict[str, Any], handle: ModelHandle | None = None) -> Any:
        """The response, with `handle` served for it (the VL model's by default)."""
        self.recorded.prompts.clear()
        self.recorded.media.clear()
        self.recorded.calls = 0
        self.serve(handle or self.vl)
        try:
            return self.client.post(path, json=body)
        finally:
            self.serve(self.vl)

    def reference(self, messages: list[dict[str, Any]]) -> tuple[list[int], np.ndarray, list]:
        """transformers' ids, pixel_values and grids of one conversation of OpenAI parts."""
        text = self.processor.tokenizer.apply_chat_template(messages, tokenize=False)
        urls = [
            part["image_url"]["url"]
            for message in messages
            if isinstance(message["content"], list)
            for part in message["content"]
            if part["type"] == "image_url"
        ]
        out = self.processor(images=[decoded(u) for u in urls] or None, text=[text])
        pixels = np.asarray(out["pixel_values"]) if urls else np.zeros((0, 0), np.float32)
        grids = np.asarray(out["image_grid_thw"]).tolist() if urls else []
        return list(np.asarray(out["input_ids"])[0]), pixels, grids

    def text_ids(self, text: str) -> list[int]:
        return list(self.processor.tokenizer(text)["input_ids"])


def assert_prompt(recorded: Recorded, index: int, want: tuple[list[int], np.ndarray, list]) -> None:
    """The engine's prompt `index` is transformers' (ids, pixel values, grids) exactly."""
    ids, pixels, grids = want
    assert recorded.prompts[index] == ids
    media = recorded.media[index]
    if not grids:
        assert media is None
        return
    assert media is not None
    assert [list(g) for g in media.grids] == grids
    got = np.concatenate(media.patches)
    assert got.dtype == np.float32 and np.array_equal(got, pixels)
    # each image's digest, cut beside its patches, is the engine's for the same image
    want_digests = [image_digest(p, g) for p, g in zip(media.patches, media.grids, strict=True)]
    assert list(media.digests) == want_digests


@pytest.fixture(scope="module", params=FAMILIES)
def vl(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VL]:
    directory = save_tiny_vl(request.param, tmp_path_factory.mktemp(request.param))
    config = json.loads((Path(directory) / "preprocessor_config.json").read_text())
    inline = InlineImages(read_grid_processing(config), "<|image_pad|>", IMAGE_TOKEN, START_TOKEN)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    processor = ImageTextProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(directory),
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=CHAT_TEMPLATE,
    )
    settings = ServerSettings(
        served_model_name=NAME,
        max_images_per_request=MAX_IMAGES,
        trust_request_chat_template=True,
    )
    with TestClient(create_app(settings)) as client:
        state: ServiceState = client.app.state.poolserve  # type: ignore[attr-defined]
        text_only = state.models[0].handle
        card = replace(text_only.card, inline_images=inline)
        handle = replace(text_only, card=card, tokenizer=tokenizer, specials=SpecialTokens((), ()))
        recorded = Recorded()
        engine = state.models[0].engine

        async def record(
            prompts: Sequence[Sequence[int]],
            params: Any,
            priority: int = 0,
            token_type_ids: Any = None,
            pixels: Any = None,
            media: Sequence[PromptImages | None] | None = None,
        ) -> list[asyncio.Future[PoolingOutput]]:
            recorded.calls += 1
            recorded.prompts.extend(list(p) for p in prompts)
            recorded.media.extend(media if media is not None else [None] * len(prompts))
            futures = []
            for index, prompt in enumerate(prompts):
                future: asyncio.Future[PoolingOutput] = asyncio.get_running_loop().create_future()
                data = np.full(8, index + 1, dtype=np.float32)
                future.set_result(PoolingOutput(index, data, len(prompt), 0.0, 0.0))
                futures.append(future)
            return futures

        engine.submit_many = record  # type: ignore[method-assign]
        served = VL(client, state, handle, text_only, processor, recorded)
        served.serve(handle)
        yield served


def conversation(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


def test_a_conversation_equals_the_processor(vl: VL) -> None:
    """Texts and images interleaved, an RGBA and a large image among them: the ids with each
    placeholder expanded, and each image's patches, as transformers makes them."""
    messages = [
        {"role": "system", "content": "w7 w8"},
        *conversation(
            text_part(TEXT), image_part(PICTURES[0]), text_part("w4"), image_part(PICTURES[1])
        ),
        {"role": "assistant", "content": "w9"},
        *conversation(image_part(PICTURES[2]), text_part("Describe")),
    ]
    response = vl.post("/v1/embeddings", {"messages": messages, "model": NAME})
    assert response.status_code == 200, response.text
    assert vl.recorded.calls == 1 and len(vl.recorded.prompts) == 1
    assert_prompt(vl.recorded, 0, vl.reference(messages))
    assert response.json()["usage"]["prompt_tokens"] == len(vl.recorded.prompts[0])


def test_the_patch_budget_is_given_back_after_each_request(vl: VL) -> None:
    """The patches' bytes are held from before they are cut until they are sent, and given back
    whether the request was answered or refused after its patches were cut."""
    patches = vl.state.media_budgets.patches
    messages = conversation(image_part(PICTURES[0]), text_part(TEXT))
    assert vl.post("/v1/embeddings", {"messages": messages, "model": NAME}).status_code == 200
    assert patches.held == 0
    refusing = vl.state.models[0].engine

    async def refuse(*args: Any, **kwargs: Any) -> Any:
        raise InvalidRequestError("refused by the engine", "input")

    answered = refusing.submit_many
    refusing.submit_many = refuse  # type: ignore[method-assign]
    try:
        response = vl.post("/v1/embeddings", {"messages": messages, "model": NAME})
    finally:
        refusing.submit_many = answered  # type: ignore[method-assign]
    assert response.status_code == 400 and patches.held == 0


def test_a_batch_of_conversations_and_the_pooling_route(vl: VL) -> None:
    """vLLM's batch of conversations: each its own prompt, one of text alone among them."""
    batch = [
        conversation(image_part(PICTURES[3])),
        conversation(text_part(TEXT)),
        conversation(text_part("w5"), image_part(PICTURES[0]), image_part(PICTURES[3])),
    ]
    response = vl.post("/v1/embeddings", {"messages": batch})
    assert response.status_code == 200, response.text
    assert [item["index"] for item in response.json()["data"]] == [0, 1, 2]
    for index, messages in enumerate(batch):
        assert_prompt(vl.recorded, index, vl.reference(messages))
    messages = conversation(text_part(TEXT), image_part(PICTURES[1]))
    pooled = vl.post("/v1/pooling", {"messages": messages, "task": "embed"})
    assert pooled.status_code == 200, pooled.text
    assert_prompt(vl.recorded, 0, vl.reference(messages))


def test_bare_images_are_one_message_conversations(vl: VL) -> None:
    """Cohere's images, Jina's input objects, Infinity's modality image: each image a
    conversation of its own; texts beside them stay texts."""
    alone = [vl.reference(conversation(image_part(url))) for url in PICTURES[:2]]
    cohere = vl.post("/v2/embed", {"model": NAME, "images": PICTURES[:2]})
    assert cohere.status_code == 200, cohere.text
    assert len(cohere.json()["embeddings"]["float"]) == 2
    for index in range(2):
        assert_prompt(vl.recorded, index, alone[index])
    jina = vl.post("/v1/embeddings", {"input": [{"text": TEXT}, {"image": PICTURES[1]}]})
    assert jina.status_code == 200, jina.text
    assert vl.recorded.prompts[0] == vl.text_ids(TEXT) and vl.recorded.media[0] is None
    assert_prompt(vl.recorded, 1, alone[1])
    infinity = vl.post("/embeddings", {"model": NAME, "input": PICTURES[:2], "modality": "image"})
    assert infinity.status_code == 200, infinity.text
    for index in range(2):
        assert_prompt(vl.recorded, index, alone[index])


def test_cohere_inputs_of_text_and_image_are_one_conversation(vl: VL) -> None:
    inputs = [
        {"content": [text_part(TEXT), image_part(PICTURES[0]), text_part("w6")]},
        {"content": [text_part("w5")]},
        {"content": [image_part(PICTURES[3])]},
    ]
    response = vl.post("/v2/embed", {"model": NAME, "inputs": inputs})
    assert response.status_code == 200, response.text
    assert_prompt(
        vl.recorded,
        0,
        vl.reference(conversation(text_part(TEXT), image_part(PICTURES[0]), text_part("w6"))),
    )
    assert vl.recorded.prompts[1] == vl.text_ids("w5") and vl.recorded.media[1] is None
    assert_prompt(vl.recorded, 2, vl.reference(conversation(image_part(PICTURES[3]))))
    broken = vl.post("/v2/embed", {"model": NAME, "inputs": [{"content": [{"type": "image_url"}]}]})
    assert broken.status_code == 400, broken.text
    assert vl.recorded.calls == 0


def refused(response: Any, param: str | None = None) -> dict[str, Any]:
    """The 400's error object (its param checked when given)."""
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    return error


def test_placeholders_must_match_the_images(vl: VL) -> None:
    """A text that writes a placeholder, a template that drops an image or writes one where no
    image opens: a 400 naming the conversation, before any image is loaded or submitted."""
    smuggled = conversation(text_part("w1 <|image_pad|>"), image_part(PICTURES[0]))
    error = refused(vl.post("/v1/embeddings", {"messages": smuggled}), "messages")
    assert "2 image placeholders" in error["message"] and "1 image" in error["message"]
    batch = [conversation(image_part(PICTURES[0])), conversation(text_part("<|image_pad|>"))]
    refused(vl.post("/v1/embeddings", {"messages": batch}), "messages[1]")
    dropped = "{% for m in messages %}{{ m['role'] }}{% endfor %}"
    body = {"messages": conversation(image_part(PICTURES[0])), "chat_template": dropped}
    assert "0 image placeholders" in refused(vl.post("/v1/pooling", body), "messages")["message"]
    unopened = (
        "{% for m in messages %}{% for c in m['content'] %}"
        "{% if c['type'] == 'image' %}<|image_pad|>{% else %}{{ c['text'] }}{% endif %}"
        "{% endfor %}{% endfor %}"
    )
    body = {"messages": conversation(text_part("w1"), image_part(PICTURES[0]))}
    refused(vl.post("/v1/embeddings", {**body, "chat_template": unopened}), "messages")
    assert vl.recorded.calls == 0


def test_too_long_is_a_400_before_any_engine_work(vl: VL) -> None:
    messages = conversation(text_part(TEXT), image_part(PICTURES[2]))
    length = len(vl.reference(messages)[0])
    short = replace(vl.vl, max_model_len=length - 1)
    error = refused(vl.post("/v1/embeddings", {"messages": messages}, short), "messages")
    assert error["code"] == "context_length_exceeded" and "max_model_len" in error["message"]
    fits = replace(vl.vl, max_model_len=length)
    assert vl.post("/v1/embeddings", {"messages": messages}, fits).status_code == 200
    cut = {"messages": messages, "truncate_prompt_tokens": length - 1}
    error = refused(vl.post("/v1/embeddings", cut), "messages")
    assert error["code"] == "context_length_exceeded"
    whole = {"messages": messages, "truncate_prompt_tokens": -1}
    assert vl.post("/v1/embeddings", whole).status_code == 200
    vl.post("/v1/embeddings", cut)
    assert vl.recorded.calls == 0


def test_images_the_processor_refuses_and_too_many(vl: VL) -> None:
    lopsided = conversation(text_part("w1"), image_part(data_url(picture(402, 2))))
    error = refused(vl.post("/v1/embeddings", {"messages": lopsided}), "messages[0].content[1]")
    assert error["code"] == "invalid_image" and "200" in error["message"]
    many = conversation(*(image_part(PICTURES[3]) for _ in range(MAX_IMAGES + 1)))
    error = refused(vl.post("/v1/embeddings", {"messages": many}), "messages")
    assert "--max-images-per-request" in error["message"]
    cohere = vl.post("/v2/embed", {"model": NAME, "inputs": [{"content": many[0]["content"]}]})
    assert "--max-images-per-request" in refused(cohere)["message"]
    broken = conversation(image_part(PICTURES[0]), image_part("data:image/png;base64,@@@"))
    refused(vl.post("/v1/embeddings", {"messages": broken}), "messages[0].content[1]")
    assert vl.recorded.calls == 0


def test_a_text_only_model_refuses_images(vl: VL) -> None:
    """Neither `images` nor `inline_images` on the card: today's 400s."""
    model = vl.text_only
    messages = conversation(text_part("w1"), image_part(PICTURES[0]))
    error = refused(vl.post("/v1/embeddings", {"messages": messages}, model), "messages")
    assert "takes no images" in error["message"]
    refused(vl.post("/v2/embed", {"model": NAME, "images": PICTURES[:1]}, model), "images")
    jina = vl.post("/v1/embeddings", {"input": [{"image": PICTURES[0]}]}, model)
    refused(jina, "input")
    infinity = {"model": NAME, "input": PICTURES[:1], "modality": "image"}
    refused(vl.post("/embeddings", infinity, model), "modality")
    assert vl.recorded.calls == 0


def test_expand_repeats_each_placeholder_by_its_grid() -> None:
    inline = InlineImages(read_grid_processing({}), "<|image_pad|>", 9, 8)
    ids = [1, 8, 9, 2, 8, 9, 3]
    assert expand(ids, [(1, 2, 4), (1, 4, 6)], inline) == [1, 8, *[9] * 2, 2, 8, *[9] * 6, 3]
