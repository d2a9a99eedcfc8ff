"""Tiny random vision-language embedders (Qwen2-VL, Qwen3-VL) saved as transformers saves them,
with a word-level tokenizer holding the Qwen special tokens, a Qwen2-VL-style chat template and
the PIL image processor's config; and their reference: transformers' own processor and model,
the last token's final hidden state of each prompt, as gme-Qwen2-VL and Qwen3-VL-Embedding
pool."""

from __future__ import annotations

import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from PIL import Image
from tokenizers import Regex, Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
WORDS = (*(f"w{i}" for i in range(80)), "system", "user", "assistant", "Describe", "\n")
IMAGE_TOKEN, VIDEO_TOKEN, START_TOKEN, END_TOKEN = 5, 6, 3, 4

# Qwen2-VL's chat template, as its checkpoints ship it (image parts as OpenAI's or HF's).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Each family's processor: Qwen2-VL's 14-pixel patches and CLIP's statistics; Qwen3-VL's
# 16-pixel patches and 0.5 statistics. Pixel bounds small enough for tiny images.
PROCESSORS: dict[str, dict[str, Any]] = {
    "qwen2_vl": {"patch_size": 14, "min_pixels": 28 * 28, "max_pixels": 28 * 28 * 16},
    "qwen2_5_vl": {"patch_size": 14, "min_pixels": 28 * 28, "max_pixels": 28 * 28 * 16},
    "qwen3_vl": {
        "patch_size": 16,
        "min_pixels": 32 * 32,
        "max_pixels": 32 * 32 * 16,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    },
}


CONFIGS: dict[str, Any] = {
    "qwen2_vl": transformers.Qwen2VLConfig,
    "qwen2_5_vl": transformers.Qwen2_5_VLConfig,
    "qwen3_vl": transformers.Qwen3VLConfig,
}
MODELS: dict[str, Any] = {
    "qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
    "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
    "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
}


def _text_config(family: str, vocab: int) -> dict[str, Any]:
    """The decoder: Qwen2's (M-RoPE sections over a 16-wide head) or Qwen3's (interleaved)."""
    common: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 0,
        "eos_token_id": 2,
    }
    if family in ("qwen2_vl", "qwen2_5_vl"):
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        return {**common, "rope_parameters": rope}
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    }
    return {**common, "head_dim": 16, "rope_parameters": rope}


def _vision_config(family: str) -> dict[str, Any]:
    """The vision tower, its output as wide as the decoder."""
    if family == "qwen2_vl":
        return {
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        }
    if family == "qwen2_5_vl":  # windows of 2x2 merged patches, the middle block attends fully
        return {
            "depth": 3,
            "hidden_size": 32,
            "intermediate_size": 48,
            "out_hidden_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        }
    return {
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": 64,
        "num_heads": 2,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0, 1],
    }


def vl_config(
    family: str,
    vocab: int,
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
) -> transformers.PretrainedConfig:
    """The whole model's config, its special token ids those of the tiny tokenizer; `text` and
    `vision` replace fields of the tiny towers' (a benchmark's geometry)."""
    ids = {
        "image_token_id": IMAGE_TOKEN,
        "video_token_id": VIDEO_TOKEN,
        "vision_start_token_id": START_TOKEN,
        "vision_end_token_id": END_TOKEN,
    }
    return CONFIGS[family](
        text_config={**_text_config(family, vocab), **(text or {})},
        vision_config={**_vision_config(family), **(vision or {})},
        tie_word_embeddings=False,
        **ids,
    )


def _tokenizer(directory: Path, extra: Sequence[str] = ()) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer with Qwen's special tokens and chat template (and `extra`
    words), saved."""
    vocab = {token: i for i, token in enumerate((*SPECIALS, *WORDS, *extra))}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<|endoftext|>"))
    # words between spaces, "\n" a word of its own (the special tokens are matched before this)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
            pre_tokenizers.Split(Regex(" "), behavior="removed"),
        ]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIALS[1:]),
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )
    fast.save_pretrained(directory)
    return fast


def save_tiny_vl(
    family: str,
    directory: Path,
    seed: int = 0,
    geometry: tuple[dict[str, Any], dict[str, Any], dict[str, Any]] | None = None,
) -> Path:
    """A tiny random `family` checkpoint with tokenizer, chat template and image processor;
    `geometry`: the text tower's, the vision tower's and the processor's fields to replace
    (weights then drawn at 0.02, as a trained model's scale)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(directory)
    text, vision, images = geometry or ({}, {}, {})
    torch.manual_seed(seed)
    model = MODELS[family](vl_config(family, len(tokenizer), text, vision))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02 if geometry else 0.2)
    model.save_pretrained(directory)
    processor().__class__(**{**PROCESSORS[family], **images}).save_pretrained(directory)
    return directory


def processor() -> Any:
    """transformers' PIL image processor for Qwen2-VL (the one the front end reproduces)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil()


class Reference:
    """transformers' processor and model over one checkpoint: the last token's final hidden
    state of each conversation, unnormalized."""

    def __init__(self, directory: Path) -> None:
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
        config = transformers.AutoConfig.from_pretrained(directory)
        self.family = config.model_type
        self.images = type(processor()).from_pretrained(directory)
        self.model = MODELS[self.family].from_pretrained(directory, dtype=torch.float32).eval()
        self.merge = int(config.vision_config.spatial_merge_size)

    def inputs(
        self, text: str, images: Sequence[Image.Image]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The processor's ids (placeholders expanded) and image tensors for rendered text."""
        extra: dict[str, torch.Tensor] = {}
        grids: list[list[int]] = []
        if images:
            out = self.images(images=list(images), return_tensors="pt")
            extra = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
            grids = out["image_grid_thw"].tolist()
        ids: list[int] = []
        expansions = iter(grids)
        for token in self.tokenizer(text, add_special_tokens=False)["input_ids"]:
            if token == IMAGE_TOKEN:
                t, h, w = next(expansions)
                ids.extend([IMAGE_TOKEN] * (t * h * w // self.merge**2))
            else:
                ids.append(token)
        return torch.tensor([ids]), extra

    @torch.no_grad()
    def hidden(self, text: str, images: Sequence[Image.Image] = ()) -> torch.Tensor:
        """[num_tokens, hidden] final-normed states of one rendered prompt."""
        ids, extra = self.inputs(text, images)
        mm_types = (ids == IMAGE_TOKEN).int()
        out = self.model.model(input_ids=ids, mm_token_type_ids=mm_types, **extra, use_cache=False)
        return out.last_hidden_state[0]

    @torch.no_grad()
    def last_logits(self, text: str, images: Sequence[Image.Image] = ()) -> torch.Tensor:
        """[vocab] the LM head's logits at the last token of one rendered prompt."""
        ids, extra = self.inputs(text, images)
        mm_types = (ids == IMAGE_TOKEN).int()
        out = self.model(input_ids=ids, mm_token_type_ids=mm_types, **extra, use_cache=False)
        return out.logits[0, -1]

    def last_hidden(self, text: str, images: Sequence[Image.Image] = ()) -> torch.Tensor:
        """[hidden] final-normed state of the last token of one rendered prompt."""
        return self.hidden(text, images)[-1]

    def render(self, messages: list[dict[str, Any]]) -> str:
        """The chat template's text of one conversation."""
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False))


def image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A random RGB image."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


# ColQwen2's prompt words ("Query: ...", "Describe the image."), beside the tiny vocabulary
COLQWEN_WORDS = ("Query:", "the", "image.")


def save_tiny_colqwen2(directory: Path, family: str = "qwen2_vl", seed: int = 0) -> Path:
    """A tiny random ColQwen2ForRetrieval (a `family` model inside, a 24-wide projection with a
    bias) with its ColQwen2Processor saved as transformers saves it (processor_config.json
    holding the image processor, the query prefix and the visual prompt)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(directory, COLQWEN_WORDS)
    vlm = vl_config(family, len(tokenizer))
    torch.manual_seed(seed)
    config = transformers.ColQwen2Config(vlm_config=vlm.to_dict(), embedding_dim=24)
    model = transformers.ColQwen2ForRetrieval(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    model.save_pretrained(directory)
    images = processor().__class__(**PROCESSORS[family])
    transformers.ColQwen2Processor(image_processor=images, tokenizer=tokenizer).save_pretrained(
        directory
    )
    return directory


class RetrieverReference:
    """A transformers retriever and its processor (`PROCESSOR`, `MODEL`): each query's and image
    document's per-token embeddings, computed alone (a batch of one, nothing padded)."""

    PROCESSOR: Any
    MODEL: Any

    def __init__(self, directory: Path) -> None:
        self.processor = self.PROCESSOR.from_pretrained(directory)
        self.model = self.MODEL.from_pretrained(directory, dtype=torch.float32).eval()

    @torch.no_grad()
    def query(self, text: str) -> tuple[list[int], torch.Tensor]:
        """The processor's query ids and their `[num_tokens, dim]` embeddings."""
        inputs = self.processor.process_queries([text])
        return inputs["input_ids"][0].tolist(), self.model(**inputs).embeddings[0]

    def maxsim(self, query: torch.Tensor, document: torch.Tensor) -> float:
        """score_retrieval of one query against one document, unpadded."""
        return float(self.processor.score_retrieval([query], [document])[0, 0])


class ColQwenReference(RetrieverReference):
    """transformers' ColQwen2Processor and ColQwen2ForRetrieval."""

    PROCESSOR = transformers.ColQwen2Processor
    MODEL = transformers.ColQwen2ForRetrieval

    @torch.no_grad()
    def document(self, picture: Image.Image) -> tuple[list[int], torch.Tensor, dict[str, Any]]:
        """The processor's ids of an image document (placeholders expanded), their embeddings,
        and its patches and grid."""
        inputs = self.processor.process_images([picture])
        embeddings = self.model(**inputs).embeddings[0]
        grid = tuple(int(v) for v in inputs["image_grid_thw"][0].tolist())
        patches = inputs["pixel_values"][0][: grid[0] * grid[1] * grid[2]]
        media = {"patches": patches.float().numpy(), "grid": grid}
        return inputs["input_ids"][0].tolist(), embeddings, media


# ColPali's tiny tokenizer: Gemma's (BPE over single characters, no merges), its BOS added by
# default as Gemma checkpoints ship it; ColPaliProcessor turns it off and writes its own
COLPALI_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<image>")
COLPALI_CHARS = ("▁", "\n", ".", ":", "?", *string.ascii_letters, *string.digits)
COLPALI_IMAGE = 28  # pixels a side: 2x2 patches of 14


def save_tiny_colpali(directory: Path, seed: int = 0) -> Path:
    """A tiny random ColPaliForRetrieval (a PaliGemma model inside: a 2-layer SigLIP tower of
    28-pixel images, a 2-layer Gemma decoder; a 24-wide projection with a bias) with its
    ColPaliProcessor saved as transformers saves it (processor_config.json holding SigLIP's
    image processor, the query prefix and the visual prompt), the tokenizer saved afterwards
    with its BOS on, as a Gemma checkpoint's is."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {token: i for i, token in enumerate((*COLPALI_SPECIALS, *COLPALI_CHARS))}
    tokenizer = transformers.GemmaTokenizer(vocab=vocab, merges=[], add_bos_token=True)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    side = {"height": COLPALI_IMAGE, "width": COLPALI_IMAGE}
    images = transformers.SiglipImageProcessorPil(size=side, image_seq_length=4)
    processor = transformers.ColPaliProcessor(image_processor=images, tokenizer=tokenizer)
    vocab_size = len(tokenizer)  # the processor's location and segment tokens included
    vlm = transformers.PaliGemmaConfig(
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "patch_size": 14,
            "image_size": COLPALI_IMAGE,
            "vision_use_head": False,
        },
        text_config={
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "vocab_size": vocab_size,
        },
        image_token_index=processor.image_token_id,
        vocab_size=vocab_size,
        projection_dim=64,
        hidden_size=64,
    )
    config = transformers.ColPaliConfig(vlm_config=vlm.to_dict(), embedding_dim=24)
    torch.manual_seed(seed)
    model = transformers.ColPaliForRetrieval(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    tokenizer.add_bos_token = True
    tokenizer.save_pretrained(directory)
    return directory


class ColPaliReference(RetrieverReference):
    """transformers' ColPaliProcessor and ColPaliForRetrieval, with everything the processor
    gives (its token type ids: PaliGemma's mask over the prompt)."""

    PROCESSOR = transformers.ColPaliProcessor
    MODEL = transformers.ColPaliForRetrieval

    @torch.no_grad()
    def document(self, picture: Image.Image) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """The processor's ids of an image document (placeholders expanded), their embeddings,
        and its pixel values `[3, height, width]`."""
        inputs = self.processor.process_images([picture])
        embeddings = self.model(**inputs).embeddings[0]
        return inputs["input_ids"][0].tolist(), embeddings, inputs["pixel_values"][0]
