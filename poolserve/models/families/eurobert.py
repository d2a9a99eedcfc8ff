"""EuroBERT: Llama's layers (RMSNorm, RoPE, GQA, SwiGLU, final norm), always bidirectional."""

from __future__ import annotations

from poolserve.models.families.records import (
    ArchitectureEntry,
    Backbone,
    DecoderFamily,
    HeadTransform,
    MaskedLMHead,
)
from poolserve.types.tasks import HeadKind

FAMILIES: dict[str, DecoderFamily] = {
    "eurobert": DecoderFamily(("EuroBertModel",), bidirectional=True),
}
# Its heads are not the decoder table's (a `score.` Linear on the last token): transformers'
# EuroBERT classifiers read `dense` + exact GELU + `classifier` (the token classifier
# `classifier` alone), and its MLM head is `lm_head` on the final states.
ARCHITECTURES: dict[str, ArchitectureEntry] = {
    "EuroBertForSequenceClassification": ArchitectureEntry(
        Backbone.DECODER,
        HeadKind.SEQUENCE_CLASSIFIER,
        ("model.",),
        "classifier.",
        HeadTransform("dense.", activation="gelu"),
        # bos: the first token's state; mean: the mean state; late: every token through the
        # head, the logits averaged
        classifier_pooling=(("bos", "cls"), ("mean", "mean"), ("late", "late")),
    ),
    "EuroBertForTokenClassification": ArchitectureEntry(
        Backbone.DECODER, HeadKind.TOKEN_CLASSIFIER, ("model.",), "classifier."
    ),
    # a backbone saved alone holds its tensors without the prefix
    "EuroBertForMaskedLM": ArchitectureEntry(Backbone.DECODER, HeadKind.MASKED_LM, ("model.", "")),
}
# lm_head: Linear(hidden, vocab, bias=mlp_bias) on the final-normed states, no transform; tied to
# the embeddings when the config says so (it does not by default).
MASKED_LM: dict[str, tuple[MaskedLMHead, ...]] = {
    "eurobert": (MaskedLMHead(None, "lm_head.", "model.embed_tokens.weight"),),
}
