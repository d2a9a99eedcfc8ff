"""ColPali (transformers' ColPaliForRetrieval): a PaliGemma model (a SigLIP vision tower, a Linear
projector and a Gemma decoder; models/paligemma.py) inside a retrieval class with a per-token
projection. PaliGemma counts positions from 1; ColPaliProcessor gives every token of a prompt
the one token type PaliGemma's mask makes a block of, so the whole prompt attends both ways."""

from __future__ import annotations

from poolserve.models.families.gemma import GEMMA
from poolserve.models.families.records import (
    ArchitectureEntry,
    Backbone,
    PatchTower,
    RetrievalPrompts,
    VisionLanguageFamily,
    WrappedVisionLanguage,
)
from poolserve.types.tasks import HeadKind

# Where checkpoints keep each part under `vlm.`: transformers saves `language_model.model.`,
# `vision_tower.` and `multi_modal_projector.linear.` (the Hub's ColPali checkpoints the tower
# under `vision_tower.vision_model.`); a PaliGemmaModel's own names are `model.`-prefixed.
PALIGEMMA_TOWER = PatchTower(
    text_prefixes=("language_model.model.", "language_model.", "model.language_model."),
    tower_prefixes=(
        "vision_tower.vision_model.",
        "vision_tower.",
        "model.vision_tower.vision_model.",
        "model.vision_tower.",
    ),
    projector_prefixes=("multi_modal_projector.linear.", "model.multi_modal_projector.linear."),
    # SiglipImageProcessorPil's class defaults (IMAGENET_STANDARD statistics, bicubic)
    processor_defaults=(
        ("size", {"height": 224, "width": 224}),
        ("resample", 3),
        ("image_mean", [0.5, 0.5, 0.5]),
        ("image_std", [0.5, 0.5, 0.5]),
    ),
)
PALIGEMMA = VisionLanguageFamily(
    GEMMA, PALIGEMMA_TOWER, mrope=False, first_position=1, bidirectional=True
)
# ColPaliProcessor: a text as "<bos>Question: " + text + "<pad>" x 10 + "\n", an image as
# "<image>" x image_seq_length + "<bos>Describe the image.\n", the tokenizer adding nothing
COLPALI_PROMPTS = RetrievalPrompts(
    query_prefix="Question: ",
    augmentation=10,
    query_end="\n",
    document="Describe the image.",
    query_opening="{bos}{prefix}",
    document_form="{image}{bos}{prompt}\n",
    no_tokenizer_specials=True,
)
WRAPPED: dict[str, WrappedVisionLanguage] = {
    "ColPaliForRetrieval": WrappedVisionLanguage(
        "vlm_config", {"paligemma": PALIGEMMA}, COLPALI_PROMPTS
    ),
}
# the model under `vlm.`, `embedding_proj_layer` (with a bias) projecting every token,
# L2-normalized per token
ARCHITECTURES: dict[str, ArchitectureEntry] = {
    "ColPaliForRetrieval": ArchitectureEntry(
        Backbone.VISION_DECODER, HeadKind.LATE_INTERACTION, ("vlm.", ""), "embedding_proj_layer."
    ),
}
