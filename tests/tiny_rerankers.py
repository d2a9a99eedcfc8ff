"""Tiny rerankers: one-label cross-encoders (BERT, XLM-R layout) and a causal LM's yes/no rows."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch
import transformers
from sentence_transformers import CrossEncoder
from tokenizers import Tokenizer, processors

from tests.tiny_encoders import TINY_ENCODERS, _perturb, save_tiny_encoder
from tests.tiny_models import MINILM_DIR

# The vLLM flag that reads a Qwen3 causal LM as a yes/no reranker.
QWEN3_YES_NO = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}


def build_cross_encoder(name: str, seed: int = 0) -> Any:
    """The named tiny encoder classifier (`bert_cls`, `xlmroberta_cls`) with one label."""
    spec = TINY_ENCODERS[name]
    torch.manual_seed(seed)
    config = getattr(transformers, spec.config_class)(**{**spec.config, "num_labels": 1})
    config._attn_implementation = "eager"
    model = getattr(transformers, spec.hf_class)(config)
    _perturb(model, seed)
    return model.eval()


def save_cross_encoder(name: str, directory: Path) -> Path:
    """A one-label cross-encoder checkpoint; XLM-R's gets its `<s> A </s></s> B </s>` layout."""
    save_tiny_encoder(name, directory, build_cross_encoder(name))
    if name.startswith("xlmroberta"):
        write_xlmr_layout_tokenizer(directory)
    return directory


def write_xlmr_layout_tokenizer(directory: Path) -> None:
    """MiniLM's vocabulary with XLM-R's pair template and no token type ids (as XLM-R's)."""
    tokenizer = Tokenizer.from_file(str(MINILM_DIR / "tokenizer.json"))
    # RoBERTa's processor: cls A sep sep B sep; [CLS]/[SEP] stand in for <s>/</s>
    tokenizer.post_processor = processors.RobertaProcessing(("[SEP]", 102), ("[CLS]", 101))
    for stale in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "vocab.txt",
    ):
        (directory / stale).unlink(missing_ok=True)
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_input_names=["input_ids", "attention_mask"],
    ).save_pretrained(directory)


def write_activation(directory: Path, where: str, path: str) -> None:
    """Save a CrossEncoder activation where a sentence-transformers version would."""
    if where == "config_sentence_transformers.json":
        # what sentence-transformers 5+ saves itself (the file is read beside its modules.json)
        module, name = path.rsplit(".", 1)
        activation = getattr(importlib.import_module(module), name)()
        CrossEncoder(str(directory), device="cpu", activation_fn=activation).save(str(directory))
        return
    config_file = directory / "config.json"
    config = json.loads(config_file.read_text())
    if where == "sentence_transformers":
        config["sentence_transformers"] = {"activation_fn": path, "version": "4.0.0"}
    else:
        config["sbert_ce_default_activation_function"] = path
    config_file.write_text(json.dumps(config))
