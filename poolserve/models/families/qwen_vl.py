"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: a Qwen2 or Qwen3 decoder fed by a vision tower
(models/vision_language.py, models/qwen_vision.py). Their decoders' rows by the text config's
model_type; each family's tower row; the classes, embedders and vLLM's reranker name; and
ColQwen2 (transformers' ColQwen2ForRetrieval), a Qwen2-VL or Qwen2.5-VL model inside a
retrieval class with a per-token projection."""

from __future__ import annotations

from poolserve.models.families.records import (
    ArchitectureEntry,
    Backbone,
    DecoderFamily,
    MergerKeys,
    MlpKeys,
    PerToken,
    RetrievalPrompts,
    VisionFamily,
    VisionLanguageFamily,
    WrappedVisionLanguage,
)
from poolserve.types.tasks import HeadKind

# The decoders, by the text config's model_type (no class of their own).
FAMILIES: dict[str, DecoderFamily] = {
    "qwen2_vl_text": DecoderFamily(()),
    "qwen2_5_vl_text": DecoderFamily(()),
    "qwen3_vl_text": DecoderFamily((), qk_norm=True),
}
# Each family's vision tower (transformers' modeling_<family>.py).
QWEN2_VL_TOWER = VisionFamily(
    width="embed_dim",
    norm="layer",
    mlp=MlpKeys(up="mlp.fc1.", down="mlp.fc2."),
    merger=MergerKeys(norm="ln_q.", fc1="mlp.0.", fc2="mlp.2."),
    patch_bias=False,
    windows=False,
    learned_positions=False,
    deepstack=False,
)
QWEN2_5_VL_TOWER = VisionFamily(
    width="hidden_size",
    norm="rms",
    mlp=MlpKeys(up="mlp.up_proj.", down="mlp.down_proj.", gate="mlp.gate_proj."),
    merger=MergerKeys(norm="ln_q.", fc1="mlp.0.", fc2="mlp.2."),
    patch_bias=False,
    windows=True,
    learned_positions=False,
    deepstack=False,
)
QWEN3_VL_TOWER = VisionFamily(
    width="hidden_size",
    norm="layer",
    mlp=MlpKeys(up="mlp.linear_fc1.", down="mlp.linear_fc2."),
    merger=MergerKeys(norm="norm.", fc1="linear_fc1.", fc2="linear_fc2."),
    patch_bias=True,
    windows=False,
    learned_positions=True,
    deepstack=True,
)
# The class-name prefix of each family, and the family.
_PREFIXES: dict[str, VisionLanguageFamily] = {
    "Qwen2VL": VisionLanguageFamily(FAMILIES["qwen2_vl_text"], QWEN2_VL_TOWER),
    "Qwen2_5_VL": VisionLanguageFamily(FAMILIES["qwen2_5_vl_text"], QWEN2_5_VL_TOWER),
    "Qwen3VL": VisionLanguageFamily(FAMILIES["qwen3_vl_text"], QWEN3_VL_TOWER),
}
# The classes whose checkpoints hold both the tower and the decoder; *ForSequenceClassification
# is no transformers class: vLLM's name (through --hf-overrides) for the LLM reranker read
# through its LM head's rows (classifier_from_token), Qwen3-VL-Reranker's.
EMBEDDERS = ("ForConditionalGeneration", "Model")
RERANKER = "ForSequenceClassification"
# class -> its family (the loader builds the model by it)
VISION_LANGUAGE: dict[str, VisionLanguageFamily] = {
    prefix + suffix: family
    for prefix, family in _PREFIXES.items()
    for suffix in (*EMBEDDERS, RERANKER)
}
# the whole checkpoint is the backbone: the decoder and the tower under their own prefixes
_EMBEDDER = ArchitectureEntry(Backbone.VISION_DECODER, HeadKind.NONE, ("",))
_RERANKER = ArchitectureEntry(
    Backbone.VISION_DECODER, HeadKind.SEQUENCE_CLASSIFIER, ("",), "score.", per_token=PerToken.HEAD
)
# ColQwen2ForRetrieval: `vlm_config` a Qwen2-VL (or Qwen2.5-VL) config, the model under
# `vlm.`, `embedding_proj_layer` (with a bias) projecting every token, L2-normalized per token
COLQWEN2_PROMPTS = RetrievalPrompts(
    query_prefix="Query: ",
    augmentation=10,
    query_end="\n",
    document="<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
    "Describe the image.<|im_end|><|endoftext|>",
)
WRAPPED: dict[str, WrappedVisionLanguage] = {
    "ColQwen2ForRetrieval": WrappedVisionLanguage(
        "vlm_config",
        {
            "qwen2_vl": VisionLanguageFamily(FAMILIES["qwen2_vl_text"], QWEN2_VL_TOWER, False),
            "qwen2_5_vl": VisionLanguageFamily(
                FAMILIES["qwen2_5_vl_text"], QWEN2_5_VL_TOWER, False
            ),
        },
        COLQWEN2_PROMPTS,
    ),
}
_RETRIEVER = ArchitectureEntry(
    Backbone.VISION_DECODER, HeadKind.LATE_INTERACTION, ("vlm.", ""), "embedding_proj_layer."
)
ARCHITECTURES: dict[str, ArchitectureEntry] = {
    **{name: _RERANKER if name.endswith(RERANKER) else _EMBEDDER for name in VISION_LANGUAGE},
    **dict.fromkeys(WRAPPED, _RETRIEVER),
}
