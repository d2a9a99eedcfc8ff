"""Tiny random dual encoders (CLIP, SigLIP, SigLIP 2 naflex) with their tokenizers and image
processors, saved as transformers saves them, and their reference embeddings from transformers
itself."""

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
from transformers.image_transforms import convert_to_rgb

FAMILIES = ("clip", "siglip", "siglip2")
WORDS = tuple(f"w{i}" for i in range(90))
MAX_TEXT_TOKENS = 16
IMAGE_SIZE, PATCH_SIZE = 32, 8
# Each family's special tokens, first ids of the vocabulary.
SPECIALS = {"clip": ("<|startoftext|>", "<|endoftext|>"), "siglip": ("<pad>", "</s>", "<unk>")}
# SigLIP 2: Gemma's special tokens, its texts padded to 64 (Siglip2Processor's max_length); its
# images cut into 4x4 patches, at most 24 of them, around a learned 4x4 grid of positions
SIGLIP2_TEXT_TOKENS, SIGLIP2_PATCH, SIGLIP2_MAX_PATCHES, SIGLIP2_GRID = 64, 4, 24, 4
SIGLIP2_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"


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


def _siglip2_tokenizer(directory: Path) -> int:
    """Siglip2Tokenizer (Gemma's BPE, lowercased) over single characters, saved as Google's
    checkpoints' are: EOS appended, padded on the right, input ids only (no attention mask)."""
    specials = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "\u2581")
    vocab = {t: i for i, t in enumerate((*specials, *SIGLIP2_CHARS))}
    transformers.Siglip2Tokenizer(
        vocab=vocab,
        merges=[],
        model_max_length=SIGLIP2_TEXT_TOKENS,
        add_bos_token=False,
        add_eos_token=True,
        padding_side="right",
        model_input_names=["input_ids"],
    ).save_pretrained(directory)
    return len(vocab)


def _save_siglip2(directory: Path, seed: int) -> Path:
    """A tiny random Siglip2Model with its tokenizer and naflex image processor."""
    vocab_size = _siglip2_tokenizer(directory)
    text = {
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": SIGLIP2_TEXT_TOKENS,
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "projection_size": 40,
    }
    vision = {
        "hidden_size": 40,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "patch_size": SIGLIP2_PATCH,
        "num_patches": SIGLIP2_GRID**2,
    }
    torch.manual_seed(seed)
    model = transformers.Siglip2Model(
        transformers.Siglip2Config(text_config=text, vision_config=vision)
    )
    _randomize(model)
    model.save_pretrained(directory)
    transformers.Siglip2ImageProcessorPil(
        patch_size=SIGLIP2_PATCH, max_num_patches=SIGLIP2_MAX_PATCHES
    ).save_pretrained(directory)
    return directory


def _randomize(model: torch.nn.Module) -> None:
    """Random everywhere: the init leaves norms at one and biases at zero."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.2)


def save_dual_encoder(family: str, directory: Path, seed: int = 0) -> Path:
    """A tiny random checkpoint of `family` with tokenizer and preprocessor_config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    if family == "siglip2":
        return _save_siglip2(directory, seed)
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
    _randomize(model)
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
            "siglip2": transformers.Siglip2ImageProcessorPil,
        }[family]
        self.processor = processor.from_pretrained(directory)

    def texts(self, texts: list[str]) -> np.ndarray:
        """[n, dim] (SigLIP's texts padded to max_length, as its processor is called; SigLIP
        2's as Siglip2Processor calls its tokenizer: to max_length 64, truncated)."""
        padding: dict[str, object] = {}
        if self.family == "siglip":
            padding = {"padding": "max_length"}
        elif self.family == "siglip2":
            padding = {"padding": "max_length", "max_length": SIGLIP2_TEXT_TOKENS}
        rows = []
        for text in texts:
            # the ids alone: SigLIP's and SigLIP 2's tokenizers give no attention mask
            ids = self.tokenizer([text], return_tensors="pt", **padding)["input_ids"]
            with torch.no_grad():
                rows.append(self.model.get_text_features(input_ids=ids).pooler_output[0])
        return torch.stack(rows).numpy()

    def pixels(self, pictures: list[Image.Image]) -> dict[str, torch.Tensor]:
        """The processor's output, each picture made RGB first as the server loads it
        (transformers' convert_to_rgb, which SigLIP 2's processor does not call)."""
        rgb = [Image.fromarray(convert_to_rgb(p, return_numpy=True)) for p in pictures]
        return dict(self.processor(images=rgb, return_tensors="pt"))

    def images(self, pictures: list[Image.Image]) -> np.ndarray:
        """[n, dim]."""
        inputs = self.pixels(pictures)
        with torch.no_grad():
            return self.model.get_image_features(**inputs).pooler_output.numpy()
