"""*ForMaskedLM heads: untied decoders, DeBERTa's two layouts, checkpoints saved without a head."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from poolserve.models import HeadKind, build_attention_metadata, load_model
from poolserve.models.registry import ENCODER_FAMILIES, MASKED_LM_LAYOUTS
from tests.models.driver import assert_close
from tests.tiny_encoders import _DEBERTA_V3, _ROBERTA, _encoder, write_tokenizer

CPU = torch.device("cpu")
PROMPT = [101, 2023, 2003, 1037, 3231, 1010, 2178, 102]


def _save(model: Any, directory: Path) -> Path:
    model.save_pretrained(directory)
    write_tokenizer(directory)
    return directory


def _hidden(directory: Path) -> tuple[Any, torch.Tensor]:
    """The loaded model and its hidden states `[T, hidden]` for PROMPT."""
    loaded = load_model(str(directory), device=CPU)
    meta = build_attention_metadata(
        seq_lens_q=[len(PROMPT)],
        context_lens=[0],
        write_kv=[False],
        block_tables=[[]],
        block_size=16,
        device=CPU,
        causal=False,
    )
    return loaded, loaded.model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), meta, None)


def _perturbed(model: Any) -> Any:
    """Random biases and norms, so a bias read from the wrong tensor shows."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("bias") or "norm" in name.lower():
                param.add_(torch.randn(param.shape, generator=gen) * 0.3)
    return model.eval()


def test_every_encoder_family_has_an_mlm_layout() -> None:
    assert set(ENCODER_FAMILIES) <= set(MASKED_LM_LAYOUTS)


@pytest.mark.parametrize(
    "config_class,model_class,config",
    [
        ("BertConfig", "BertForMaskedLM", _encoder(tie_word_embeddings=False)),
        ("DebertaV2Config", "DebertaV2ForMaskedLM", {**_DEBERTA_V3, "legacy": False}),
    ],
    ids=["bert_untied", "deberta_lm_predictions"],
)
def test_mlm_layout_variants_equal_hf(
    tmp_path: Path, config_class: str, model_class: str, config: dict[str, object]
) -> None:
    torch.manual_seed(0)
    hf_config = getattr(transformers, config_class)(**config)
    hf_config._attn_implementation = "eager"
    hf = _perturbed(getattr(transformers, model_class)(hf_config))
    loaded, hidden = _hidden(_save(hf, tmp_path))
    assert loaded.head is not None
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([PROMPT])).logits[0]
        assert_close(loaded.head(hidden), want)


def test_masked_lm_saved_without_its_head_serves_dense_tasks(tmp_path: Path) -> None:
    # sentence-transformers saves an MLM-derived embedder's backbone alone, unprefixed
    torch.manual_seed(0)
    hf = _perturbed(transformers.RobertaModel(transformers.RobertaConfig(**_ROBERTA)))
    directory = _save(hf, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["RobertaForMaskedLM"]
    (directory / "config.json").write_text(json.dumps(config))
    loaded, hidden = _hidden(directory)
    assert loaded.head is None
    assert loaded.spec.head_kind is HeadKind.MASKED_LM
    with torch.no_grad():
        assert_close(hidden, hf(input_ids=torch.tensor([PROMPT])).last_hidden_state[0])
