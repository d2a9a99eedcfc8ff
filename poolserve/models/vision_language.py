"""Vision-language embedders (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) and ColQwen2 retrievers: the packed
decoder with a vision tower whose merged patches stand in the token stream in place of their
placeholders.

The decoder is the shared one (decoder.py) with M-RoPE (rope.py) and, for Qwen3-VL, deepstack
rows added after its first layers; the vision tower is qwen_vision.py. A request's images run
through the tower once, when the first of its chunks holding image tokens runs, and their rows
are kept for its later chunks (engine/vision_rows.py). Each family's facts are one row; a
class that holds the model under a config field (ColQwen2ForRetrieval's `vlm_config`) finds
its family by that config's model_type, and runs with sequential positions as transformers does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from poolserve.models.attention import AttentionBackend
from poolserve.models.decoder import DecoderModel
from poolserve.models.families.qwen_vl import VISION_LANGUAGE
from poolserve.models.families.records import VisionFamily, VisionLanguageFamily
from poolserve.models.qwen_vision import QwenVision, VisionOutput
from poolserve.models.registry import WRAPPED
from poolserve.models.weights import strip_prefix
from poolserve.types.errors import ModelLoadError, UnsupportedArchitectureError
from poolserve.types.vision import InlineImages, RetrievalForms, read_grid_processing

# Where checkpoints keep each part: transformers 5 saves `model.language_model.` and
# `model.visual.`; Qwen2-VL's Hub checkpoints `model.` and `visual.`. The first that holds the
# part wins.
TEXT_PREFIXES = ("model.language_model.", "language_model.", "model.")
VISION_PREFIXES = ("model.visual.", "visual.")


def part(state: dict[str, torch.Tensor], prefixes: tuple[str, ...], marker: str) -> str:
    """The first prefix under which `marker` is stored."""
    for prefix in prefixes:
        if f"{prefix}{marker}" in state:
            return prefix
    raise ModelLoadError(f"no {marker} under any of the prefixes {list(prefixes)}")


def vision_language(config: PretrainedConfig) -> tuple[VisionLanguageFamily, PretrainedConfig]:
    """The family of a vision-language checkpoint's class and the config of its Qwen-VL model
    (a wrapping class's: the config under its field, found by that config's model_type)."""
    architecture = str((config.architectures or [""])[0])
    wrapped = WRAPPED.get(architecture)
    if wrapped is None:
        return VISION_LANGUAGE[architecture], config
    inner = getattr(config, wrapped.config_field)
    family = wrapped.families.get(str(inner.model_type))
    if family is None:
        raise UnsupportedArchitectureError(
            f"{architecture} of a {inner.model_type} model",
            tuple(f"{architecture} of a {name} model" for name in wrapped.families),
        )
    return family, inner


class VisionLanguageModel(DecoderModel):
    """The decoder over packed tokens, with the vision tower its image tokens come from."""

    position_rows = 3

    def __init__(
        self,
        config: PretrainedConfig,
        state: dict[str, torch.Tensor],
        family: VisionLanguageFamily,
        backend: AttentionBackend,
        placement: tuple[torch.device, torch.dtype],
    ) -> None:
        text_state = strip_prefix(state, part(state, TEXT_PREFIXES, "embed_tokens.weight"))
        super().__init__(config.text_config, text_state, family.decoder, backend, placement)
        vision_prefix = part(state, VISION_PREFIXES, "patch_embed.proj.weight")
        assert isinstance(family.tower, VisionFamily)
        self.visual = QwenVision(
            family.tower, config.vision_config, strip_prefix(state, vision_prefix), placement
        )

    def embed_images(
        self, patches: torch.Tensor, grids: tuple[tuple[int, int, int], ...]
    ) -> VisionOutput:
        """Every image's merged tokens (and deepstack rows), images in order."""
        return self.visual(patches, grids)


def inline_images(
    path: Path, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase
) -> InlineImages:
    """What the front ends need to place images in a prompt: the checkpoint's image processor
    (preprocessor_config.json, or the one inside processor_config.json), its placeholder
    token, an image's text (the vision start, placeholder and vision end tokens) for a score
    template's image documents; a retriever's positions and prompt forms."""
    architecture = str((config.architectures or [""])[0])
    family, config = vision_language(config)
    processing = read_grid_processing(image_processor(path))
    merge = int(config.vision_config.spatial_merge_size)
    patch = int(config.vision_config.patch_size)
    if (processing.merge_size, processing.patch_size) != (merge, patch):
        raise ModelLoadError(
            f"preprocessor_config.json's patch {processing.patch_size} and merge "
            f"{processing.merge_size} differ from the vision tower's {patch} and {merge}"
        )
    ids = {
        name: int(getattr(config, name))
        for name in ("vision_start_token_id", "image_token_id", "vision_end_token_id")
    }
    tokens: dict[str, str] = {}
    for name, token_id in ids.items():
        token = tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(token, str):
            raise ModelLoadError(f"the tokenizer has no token {token_id} ({name})")
        tokens[name] = token
    return InlineImages(
        processing,
        tokens["image_token_id"],
        ids["image_token_id"],
        ids["vision_start_token_id"],
        placeholder="".join(tokens.values()),  # start, placeholder, end: vLLM's image text
        mrope=family.mrope,
        retrieval=retrieval_forms(
            path,
            architecture,
            tokenizer,
            tokens["image_token_id"],
            tokens["vision_start_token_id"] + tokens["image_token_id"],
        ),
    )


def image_processor(path: Path) -> dict[str, Any]:
    """The image processor's fields: preprocessor_config.json, else processor_config.json's
    `image_processor` (how transformers 5 saves a processor's parts)."""
    file = path / "preprocessor_config.json"
    if file.is_file():
        return dict(json.loads(file.read_text()))
    file = path / "processor_config.json"
    if file.is_file():
        nested = json.loads(file.read_text()).get("image_processor")
        if isinstance(nested, dict):
            return nested
    raise ModelLoadError(
        f"{path} has no preprocessor_config.json (nor an image processor in "
        "processor_config.json): its images cannot be read"
    )


def retrieval_tokenizer(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """A retriever's tokenizer as its processor sets it: ColPaliProcessor turns the tokenizer's
    BOS and EOS off (its prompt forms write the BOS); refused at load where they stay on."""
    wrapped = WRAPPED.get(str((config.architectures or [""])[0]))
    if wrapped is None or not wrapped.prompts.no_tokenizer_specials:
        return
    for name in ("add_bos_token", "add_eos_token"):
        if hasattr(tokenizer, name):
            setattr(tokenizer, name, False)
    probe = "a"
    if tokenizer(probe)["input_ids"] != tokenizer(probe, add_special_tokens=False)["input_ids"]:
        raise ModelLoadError(
            "the tokenizer adds special tokens its retrieval processor turns off, and they "
            "cannot be turned off here"
        )


def retrieval_forms(
    path: Path,
    architecture: str,
    tokenizer: PreTrainedTokenizerBase,
    image_token: str,
    opening: str,
) -> RetrievalForms | None:
    """A retriever's prompts as its processor writes them: processor_config.json's
    query_prefix and visual_prompt_prefix (the class's defaults where absent or empty) in the
    class's forms around them, the tokenizer's pad token as the query augmentation token (and
    its BOS where the forms write one); the document must hold one image placeholder, after
    `opening`. None for other classes."""
    wrapped = WRAPPED.get(architecture)
    if wrapped is None:
        return None
    file = path / "processor_config.json"
    saved: dict[str, Any] = json.loads(file.read_text()) if file.is_file() else {}
    defaults = wrapped.prompts
    pad, bos = tokenizer.pad_token, tokenizer.bos_token
    if not isinstance(pad, str):
        raise ModelLoadError(
            f"{architecture}: the tokenizer has no pad token, its query augmentation token"
        )
    if "{bos}" in defaults.query_opening + defaults.document_form and not isinstance(bos, str):
        raise ModelLoadError(
            f"{architecture}: the tokenizer has no BOS token, which its prompts open"
        )
    prefix = defaults.query_opening.format(
        bos=bos, prefix=saved.get("query_prefix") or defaults.query_prefix
    )
    document = defaults.document_form.format(
        image=image_token, bos=bos, prompt=saved.get("visual_prompt_prefix") or defaults.document
    )
    if document.count(image_token) != 1 or opening not in document:
        raise ModelLoadError(
            f"{architecture}: visual_prompt_prefix {document!r} must hold one image "
            f"placeholder {opening!r}"
        )
    suffix = pad * defaults.augmentation + defaults.query_end
    return RetrievalForms(str(prefix), suffix, str(document))


def text_config(config: PretrainedConfig) -> Any:
    """The decoder's config, which holds the sizes every other layer reads."""
    return config.text_config
