"""A tiny random bge-m3: XLMRobertaModel, an XLM-R sentencepiece-style tokenizer, and the two
heads FlagEmbedding saves beside it; plus FlagEmbedding's BGEM3 encode() and compute_score()
rebuilt by hand.

FlagEmbedding 1.4 does not import under transformers 5 (its reranker package imports
transformers.modeling_attn_mask_utils), so `reference_encode` follows its code instead:
inference/embedder/encoder_only/m3.py `encode_single_device` (`_process_token_weights`,
`_process_colbert_vecs`) over finetune/embedder/encoder_only/m3/modeling.py
`EncoderOnlyEmbedderM3ModelForInference.forward` with normalize_embeddings=True; and
`reference_compute_score` its `compute_score_single_device`. Against FlagEmbedding 1.4.2 itself
(under transformers 4.57, colbert_dim=COLBERT_DIM) the latter's scores agree within 4e-7
relative on these texts, batched or a pair at a time.
"""

from __future__ import annotations

import string
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers

# Texts of several lengths whose words repeat (a token id's weight is its largest token's) and
# include a character outside the vocabulary (UNK, dropped from the lexical weights).
TEXTS = (
    "hello world",
    "the sparse weights of the retrieval model weigh the words of the text",
    "bge m3 gives dense sparse and colbert outputs from one pass " * 4,
    "x",
    "tokens \u2603 unknown",
    "words <mask> of text",  # FlagEmbedding keeps <mask> in the lexical weights
)
_WORDS = [
    *("hello", "world", "the", "sparse", "weights", "of", "retrieval", "model", "weigh"),
    *("words", "text", "bge", "m3", "gives", "dense", "and", "colbert", "outputs", "from"),
    *("one", "pass", "tokens", "unknown"),
]
HIDDEN = 64
COLBERT_DIM = 48
SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")


def _vocab() -> list[tuple[str, float]]:
    """XLM-R's specials first (ids 0-3, as the real model), whole words, then single pieces."""
    pieces = [f"\u2581{w}" for w in _WORDS]
    pieces += [f"\u2581{c}" for c in string.ascii_lowercase + string.digits]
    pieces += list(string.ascii_lowercase + string.digits)
    scored = [(p, -float(len(pieces) - i)) for i, p in enumerate(pieces)]
    return [(s, 0.0) for s in SPECIALS] + scored + [("<mask>", 0.0)]


def build_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """A Unigram XLM-R tokenizer over a small vocabulary (no sentencepiece model needed)."""
    return transformers.XLMRobertaTokenizerFast(vocab=_vocab())


def build_backbone(vocab_size: int, seed: int = 0) -> transformers.XLMRobertaModel:
    """A random XLMRobertaModel (no pooler, as bge-m3's saved model), eager attention."""
    torch.manual_seed(seed)
    config = transformers.XLMRobertaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=514,
        type_vocab_size=1,
        initializer_range=0.25,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    config._attn_implementation = "eager"
    model = transformers.XLMRobertaModel(config, add_pooling_layer=False)
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():  # random norms and biases: a skipped one shows
        for name, param in sorted(model.named_parameters()):
            if name.endswith(".bias") or "LayerNorm" in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.3)
    return model.eval()


def build_heads(seed: int = 0) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    """sparse_linear (hidden -> 1) and colbert_linear (hidden -> COLBERT_DIM), random."""
    torch.manual_seed(seed + 11)
    sparse = torch.nn.Linear(HIDDEN, 1)
    colbert = torch.nn.Linear(HIDDEN, COLBERT_DIM)
    with torch.no_grad():
        sparse.weight.mul_(4.0)  # enough spread that some weights are zero and some are not
    return sparse, colbert


@dataclass(frozen=True)
class TinyM3:
    """The saved folder and the modules it was saved from."""

    path: Path
    tokenizer: transformers.PreTrainedTokenizerBase
    backbone: transformers.XLMRobertaModel
    sparse: torch.nn.Linear
    colbert: torch.nn.Linear


def save_tiny_m3(directory: Path, seed: int = 0) -> TinyM3:
    """The folder as bge-m3 ships it: config, safetensors, tokenizer, the two heads' .pt."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    backbone = build_backbone(len(tokenizer), seed)
    sparse, colbert = build_heads(seed)
    backbone.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    # FlagEmbedding's BGEM3 save(): torch.save of each Linear's state dict, cloned to the CPU
    for module, name in ((sparse, "sparse_linear.pt"), (colbert, "colbert_linear.pt")):
        torch.save({k: v.clone() for k, v in module.state_dict().items()}, directory / name)
    return TinyM3(directory, tokenizer, backbone, sparse, colbert)


@dataclass(frozen=True)
class M3Reference:
    """BGEM3FlagModel.encode(return_dense, return_sparse, return_colbert_vecs)'s three outputs."""

    dense_vecs: np.ndarray  # [texts, hidden]
    lexical_weights: list[dict[str, float]]  # token id (a string) -> weight
    colbert_vecs: list[np.ndarray]  # [tokens - 1, dim] per text


@torch.no_grad()
def reference_encode(m3: TinyM3, texts: list[str], max_length: int = 8192) -> M3Reference:
    """FlagEmbedding's BGEM3 encode of `texts` in one padded batch, float32 on the CPU."""
    tokenizer = m3.tokenizer
    encoded = [tokenizer(t, truncation=True, max_length=max_length) for t in texts]
    batch = tokenizer.pad(
        {"input_ids": [e["input_ids"] for e in encoded]}, padding=True, return_tensors="pt"
    )
    last = m3.backbone(**batch, return_dict=True).last_hidden_state  # [B, L, hidden]
    mask = batch["attention_mask"]  # [B, L]
    dense = torch.nn.functional.normalize(last[:, 0], dim=-1)  # cls pooling
    token_weights = torch.relu(m3.sparse(last)).squeeze(-1)  # [B, L]
    colbert = m3.colbert(last[:, 1:]) * mask[:, 1:][:, :, None].float()
    colbert = torch.nn.functional.normalize(colbert, dim=-1)  # [B, L - 1, dim]
    unused = set()
    for name in ("cls_token", "eos_token", "pad_token", "unk_token"):
        if name in tokenizer.special_tokens_map:
            unused.add(tokenizer.convert_tokens_to_ids(tokenizer.special_tokens_map[name]))
    lexical = []
    for weights, ids in zip(token_weights.numpy(), batch["input_ids"].tolist(), strict=True):
        result: dict[str, float] = defaultdict(int)
        for w, idx in zip(weights, ids, strict=True):
            if idx not in unused and w > 0 and w > result[str(idx)]:
                result[str(idx)] = float(w)
        lexical.append(dict(result))
    vectors = [
        colbert[i, : int(mask[i].sum()) - 1].numpy() for i in range(len(texts))
    ]  # the tokens after CLS, EOS included
    return M3Reference(dense.numpy(), lexical, vectors)


# FlagEmbedding's compute_score keys: each mode's score, then the weighted sums
SCORE_KEYS = ("dense", "sparse", "colbert", "sparse+dense", "colbert+sparse+dense")


@torch.no_grad()
def reference_compute_score(
    m3: TinyM3,
    pairs: list[tuple[str, str]],
    weights: list[float] | None = None,
    *,
    batch_size: int = 256,
    max_query_length: int = 512,
    max_passage_length: int = 512,
) -> dict[str, list[float]]:
    """BGEM3FlagModel.compute_score(pairs, weights_for_different_modes=weights), float32 on the
    CPU: inference/embedder/encoder_only/m3.py `compute_score_single_device` over the model's
    `compute_dense_score`, `compute_sparse_score` (vocabulary-sized lexical weights) and
    `compute_colbert_score` (the queries' padded token vectors in one batch, the passages' in
    another; MaxSim summed over the query's vectors, over their count)."""
    tokenizer = m3.tokenizer
    unused = [
        tokenizer.cls_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        tokenizer.unk_token_id,
    ]
    vocab_size = m3.backbone.config.vocab_size

    def tokenize(texts: list[str], max_length: int) -> transformers.BatchEncoding:
        return tokenizer(
            texts,
            max_length=max_length,
            padding=True,
            return_token_type_ids=False,
            truncation=True,
            return_tensors="pt",
        )

    def forward(inputs: transformers.BatchEncoding) -> tuple[torch.Tensor, ...]:
        last = m3.backbone(**inputs, return_dict=True).last_hidden_state  # [B, L, hidden]
        mask = inputs["attention_mask"]
        dense = torch.nn.functional.normalize(last[:, 0], dim=-1)
        token_weights = torch.relu(m3.sparse(last)).squeeze(-1)  # [B, L]
        sparse = torch.zeros(len(last), vocab_size).scatter_reduce(
            -1, inputs["input_ids"], token_weights, reduce="amax"
        )
        sparse[:, unused] *= 0.0
        colbert = m3.colbert(last[:, 1:]) * mask[:, 1:][:, :, None].float()
        return dense, sparse, torch.nn.functional.normalize(colbert, dim=-1)

    w = [1.0, 1.0, 1.0] if weights is None else weights
    scores: dict[str, list[float]] = {key: [] for key in SCORE_KEYS}
    for start in range(0, len(pairs), batch_size):
        batch = pairs[start : start + batch_size]
        queries = tokenize([q for q, _ in batch], max_query_length)
        passages = tokenize([p for _, p in batch], max_passage_length)
        q_dense, q_sparse, q_colbert = forward(queries)
        p_dense, p_sparse, p_colbert = forward(passages)
        token_scores = torch.einsum("qin,pjn->qipj", q_colbert, p_colbert)
        colbert = token_scores.max(-1).values.sum(1) / queries["attention_mask"][:, 1:].sum(
            -1, keepdim=True
        )
        inx = torch.arange(len(batch))
        dense = (q_dense @ p_dense.T)[inx, inx]
        sparse = (q_sparse @ p_sparse.T)[inx, inx]
        colbert = colbert[inx, inx]
        scores["dense"] += dense.tolist()
        scores["sparse"] += sparse.tolist()
        scores["colbert"] += colbert.tolist()
        scores["sparse+dense"] += ((sparse * w[1] + dense * w[0]) / (w[1] + w[0])).tolist()
        combined = (colbert * w[2] + sparse * w[1] + dense * w[0]) / sum(w)
        scores["colbert+sparse+dense"] += combined.tolist()
    return scores
