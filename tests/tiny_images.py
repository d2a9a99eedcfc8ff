"""Tiny random dual encoders (CLIP, SigLIP) with their tokenizers and image processors, saved as
transformers saves them, and their reference embeddings from transformers itself."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image
from tokenizers import Tokenizer, pre_tokenizers, processors
from tokenizers.models import WordLevel

FAMILIES = ("clip", "siglip")
WORDS = tuple(f"w{i}" for i in range(90))
MAX_TEXT_TOKENS = 16
IMAGE_SIZE, PATCH_SIZE = 32, 8
# Each family's special tokens, first ids of the vocabulary.
SPECIALS = {"clip": ("<|startoftext|>", "<|endoftext|>"), "siglip": ("<pad>", "</s>", "<unk>")}


def _tokenizer(directory: Path, family: str) -> int:
    """A word-level tokenizer laid out as the family's (CLIP: BOS text EOS; SigLIP: text EOS)."""
    specials = SPECIALS[family]
    vocab = {token: i for i, token in enumerate((*specials, *WORDS))}
    unk = "<unk>" if family == "siglip" else "<|endoftext|>"
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=unk))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    if family == "clip":
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<|startoftext|> $A <|endoftext|>",
            special_tokens=[("<|startoftext|>", 0), ("<|endoftext|>", 1)],
        )
        names = {"bos_token": specials[0], "eos_token": specials[1], "pad_token": specials[1]}
    else:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="$A </s>", special_tokens=[("</s>", 1)]
        )
        names = {"eos_token": "</s>", "pad_token": "<pad>"}
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, model_max_length=MAX_TEXT_TOKENS, unk_token=unk, **names
    ).save_pretrained(directory)
    return len(vocab)


def save_dual_encoder(family: str, directory: Path, seed: int = 0) -> Path:
    """A tiny random checkpoint of `family` with tokenizer and preprocessor_config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab_size = _tokenizer(directory, family)
    text = {
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": MAX_TEXT_TOKENS,
        "eos_token_id": 1,
    }
    vision = {
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH_SIZE,
    }
    torch.manual_seed(seed)
    model: torch.nn.Module
    if family == "clip":
        text.update(bos_token_id=0, pad_token_id=1)
        model = transformers.CLIPModel(
            transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=24)
        )
        processor: object = transformers.CLIPImageProcessorPil(
            size={"shortest_edge": IMAGE_SIZE},
            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        )
    else:
        text.update(pad_token_id=0, projection_size=vision["hidden_size"])
        model = transformers.SiglipModel(
            transformers.SiglipConfig(text_config=text, vision_config=vision)
        )
        processor = transformers.SiglipImageProcessorPil(
            size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
        )
    with torch.no_grad():  # random everywhere: the init leaves norms at one and biases at zero
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.2)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)  # type: ignore[attr-defined]
    return directory


def images(count: int, seed: int = 0) -> list[Image.Image]:
    """Random images of several sizes and modes (RGB, RGBA, grey)."""
    rng = np.random.default_rng(seed)
    made = []
    for i in range(count):
        height, width = 24 + 13 * i, 40 + 7 * (i % 3)
        mode = ("RGB", "RGBA", "L")[i % 3]
        channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
        pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
        made.append(Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode))
    return made


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    """The image as a base64 data URL."""
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    encoded = base64.b64encode(buffer.getvalue()).decode()
    return f"data:image/{fmt.lower()};base64,{encoded}"


class Reference:
    """transformers' embeddings of one checkpoint: get_text_features, get_image_features."""

    def __init__(self, directory: Path, family: str) -> None:
        self.family = family
        self.model = transformers.AutoModel.from_pretrained(directory).eval()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
        # the PIL processors: transformers' reference backend, whatever else is installed
        processor = {
            "clip": transformers.CLIPImageProcessorPil,
            "siglip": transformers.SiglipImageProcessorPil,
        }[family]
        self.processor = processor.from_pretrained(directory)

    def texts(self, texts: list[str]) -> np.ndarray:
        """[n, dim] (SigLIP's texts padded to max_length, as its processor is called)."""
        padding = {"padding": "max_length"} if self.family == "siglip" else {}
        rows = []
        for text in texts:
            ids = self.tokenizer([text], return_tensors="pt", **padding)["input_ids"]
            with torch.no_grad():
                rows.append(self.model.get_text_features(input_ids=ids).pooler_output[0])
        return torch.stack(rows).numpy()

    def images(self, pictures: list[Image.Image]) -> np.ndarray:
        """[n, dim]."""
        pixels = self.processor(images=pictures, return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            return self.model.get_image_features(pixel_values=pixels).pooler_output.numpy()
