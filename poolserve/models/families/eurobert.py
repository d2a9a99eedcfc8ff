"""EuroBERT: Llama's layers (RMSNorm, RoPE, GQA, SwiGLU, final norm), always bidirectional."""

from __future__ import annotations

from poolserve.models.families.records import DecoderFamily

# Only the base class: its heads (late/bos/mean-pooled dense + GELU classifier, an MLM lm_head
# with mlp_bias) have no row in the decoder's head table.
FAMILIES: dict[str, DecoderFamily] = {
    "eurobert": DecoderFamily(("EuroBertModel",), bidirectional=True),
}
