"""Where each encoder family's *ForMaskedLM checkpoint keeps its MLM head, by config model_type."""

from __future__ import annotations

from dataclasses import dataclass

from poolserve.models.registry import HeadTransform


@dataclass(frozen=True)
class MaskedLMHead:
    """One MLM head layout: a transform (dense, activation, LayerNorm), then the decoder."""

    transform: HeadTransform
    decoder_prefix: str  # the decoder Linear; its own weight is read only when the config unties it
    embeddings: str  # the word embedding tensor `[vocab, hidden]` a tied decoder reuses
    bias: str | None = None  # the head's own bias (BERT's cls.predictions.bias), before decoder's


def _predictions(
    backbone: str, head: str = "cls.predictions.", norm: str = "LayerNorm"
) -> MaskedLMHead:
    """BERT's layout: transform.dense, hidden_act, transform.<norm>, decoder, separate bias."""
    transform = HeadTransform(
        f"{head}transform.dense.",
        activation_key="hidden_act",
        norm_prefix=f"{head}transform.{norm}.",
    )
    word_embeddings = f"{backbone}embeddings.word_embeddings.weight"
    return MaskedLMHead(transform, f"{head}decoder.", word_embeddings, f"{head}bias")


def _lm_head(backbone: str) -> MaskedLMHead:
    """RoBERTa's and MPNet's layout: lm_head.dense, exact GELU (whatever hidden_act says)."""
    transform = HeadTransform(
        "lm_head.dense.", activation="gelu", norm_prefix="lm_head.layer_norm."
    )
    word_embeddings = f"{backbone}embeddings.word_embeddings.weight"
    return MaskedLMHead(transform, "lm_head.decoder.", word_embeddings, "lm_head.bias")


_DISTILBERT = MaskedLMHead(
    HeadTransform(
        "vocab_transform.", activation_key="activation", norm_prefix="vocab_layer_norm.", eps=1e-12
    ),
    "vocab_projector.",
    "distilbert.embeddings.word_embeddings.weight",
)
_MODERNBERT = MaskedLMHead(
    HeadTransform(
        "head.dense.",
        activation_key="classifier_activation",
        norm_prefix="head.norm.",
        eps_key="norm_eps",
    ),
    "decoder.",
    "model.embeddings.tok_embeddings.weight",
)
# DeBERTa-v2/v3 checkpoints without `legacy` layout keep the head under lm_predictions and always
# decode with the word embeddings (there is no decoder Linear to untie).
_DEBERTA = MaskedLMHead(
    HeadTransform(
        "lm_predictions.lm_head.dense.",
        activation_key="hidden_act",
        norm_prefix="lm_predictions.lm_head.LayerNorm.",
    ),
    "lm_predictions.lm_head.decoder.",
    "deberta.embeddings.word_embeddings.weight",
    "lm_predictions.lm_head.bias",
)
_ROBERTA = (_lm_head("roberta."),)

# model_type -> the MLM head layouts a checkpoint may use, tried in order: the first whose dense
# weight the checkpoint holds wins (transformers picks DeBERTa's by config.legacy instead).
MASKED_LM_LAYOUTS: dict[str, tuple[MaskedLMHead, ...]] = {
    "bert": (_predictions("bert."),),
    "distilbert": (_DISTILBERT,),
    "roberta": _ROBERTA,
    "xlm-roberta": _ROBERTA,
    "camembert": _ROBERTA,
    "mpnet": (_lm_head("mpnet."),),
    "modernbert": (_MODERNBERT,),
    "nomic_bert": (_predictions("nomic_bert.", norm="layer_norm"),),
    "deberta-v2": (_predictions("deberta."), _DEBERTA),
}
