"""ColBERT checkpoints (a BERT backbone and a token projection): the class, where the projection
lives, the config fields stating its width, and the files naming prompt handling we refuse."""

from __future__ import annotations

from poolserve.models.families.records import ArchitectureEntry, Backbone
from poolserve.types.tasks import HeadKind

ARCHITECTURES: dict[str, ArchitectureEntry] = {
    # Stanford ColBERT's class: a BERT backbone under `bert.`, its projection `linear` beside it.
    "HF_ColBERT": ArchitectureEntry(Backbone.ENCODER, HeadKind.LATE_INTERACTION, ("bert.", "")),
}

# Where checkpoints keep the projection `[dim, hidden]` (no bias): Stanford ColBERT's HF_ColBERT
# saves `linear.weight` at the root; other exports name it `colbert_linear`, some under the
# backbone's prefix (the names vLLM's ColBERT loader accepts).
PROJECTION_NAMES = (
    "linear.weight",
    "colbert_linear.weight",
    "bert.linear.weight",
    "bert.colbert_linear.weight",
    "model.linear.weight",
    "model.colbert_linear.weight",
)
# Config fields that may state the projection's width (checked against the weight).
DIM_FIELDS = ("colbert_dim", "dim", "projection_dim")
# Stanford ColBERT's training record: its presence means the model was trained with query and
# document marker tokens, [MASK] query augmentation and punctuation masking.
STANFORD_METADATA = "artifact.metadata"
# PyLate's sentence-transformers config fields that change how texts become prompts.
PYLATE_PROMPT_FIELDS = ("query_prefix", "document_prefix", "do_query_expansion")
