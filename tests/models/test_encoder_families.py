"""Encoder families (BERT token types to DeBERTa-v3) equal transformers, packed, with heads."""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from poolserve.models import (
    HeadKind,
    LoadedModel,
    ModelLoadError,
    UnsupportedArchitectureError,
    build_attention_metadata,
    load_model,
)
from poolserve.models.attention_cpu import ReferenceAttention
from poolserve.models.attention_cuda import CudaAttention
from poolserve.models.registry import ENCODER_FAMILIES, supported_architectures
from tests.models.driver import BLOCK_SIZE, assert_close, make_prompts
from tests.models.test_attention import modern_varlen
from tests.tiny_encoders import (
    TINY_ENCODERS,
    build_hf_encoder,
    encoder_dirs,
    write_remote_nomic_config,
)

CPU = torch.device("cpu")
SEQUENCE_CLASSIFIERS = sorted(n for n, s in TINY_ENCODERS.items() if "Sequence" in s.hf_class)
TOKEN_CLASSIFIERS = sorted(n for n, s in TINY_ENCODERS.items() if "Token" in s.hf_class)
MASKED_LMS = sorted(n for n, s in TINY_ENCODERS.items() if "MaskedLM" in s.hf_class)
# name -> whether its embeddings add a token type row; DeBERTa-v3 has none and ignores the ids.
TYPED = {"bert": True, "debertav2": True, "nomicbert": True, "debertav3_reward": False}


@pytest.fixture(scope="module")
def hf() -> Callable[[str], Any]:
    """name -> the transformers reference model (cached)."""
    return functools.cache(build_hf_encoder)


@pytest.fixture(scope="module")
def directory(
    tmp_path_factory: pytest.TempPathFactory, hf: Callable[[str], Any]
) -> Callable[[str], Path]:
    """name -> directory of the tiny checkpoint, saved from the reference model (once)."""
    return encoder_dirs(tmp_path_factory, hf)


@pytest.fixture(scope="module")
def loaded(directory: Callable[[str], Path]) -> Callable[[str], LoadedModel]:
    """name -> the tiny checkpoint loaded by load_model() on the CPU (cached)."""
    return functools.cache(lambda name: load_model(str(directory(name)), device=CPU))


def run_packed(
    loaded: LoadedModel, prompts: list[list[int]], types: list[list[int]] | None = None
) -> list[torch.Tensor]:
    """Every prompt whole in one packed forward, with optional token type ids."""
    meta = build_attention_metadata(
        seq_lens_q=[len(p) for p in prompts],
        context_lens=[0] * len(prompts),
        write_kv=[False] * len(prompts),
        block_tables=[[] for _ in prompts],
        block_size=BLOCK_SIZE,
        device=CPU,
        causal=False,
    )
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    type_ids = None if types is None else torch.tensor([t for row in types for t in row])
    hidden = loaded.model(ids, positions, meta, None, token_type_ids=type_ids)
    return list(hidden.split([len(p) for p in prompts]))


def _logits(model: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).logits[0]


@pytest.mark.parametrize("name", sorted(TINY_ENCODERS))
def test_packed_batch_equals_hf(
    name: str,
    loaded: Callable[[str], LoadedModel],
    hf: Callable[[str], Any],
    prompts: list[list[int]],
) -> None:
    model = loaded(name)
    assert not model.spec.is_causal
    for prompt, ours in zip(prompts, run_packed(model, prompts), strict=True):
        with torch.no_grad():
            want = hf(name).base_model(input_ids=torch.tensor([prompt])).last_hidden_state[0]
        assert_close(ours, want)


@pytest.mark.parametrize("name", SEQUENCE_CLASSIFIERS)
def test_sequence_classifier_heads_equal_hf(
    name: str,
    loaded: Callable[[str], LoadedModel],
    hf: Callable[[str], Any],
    prompts: list[list[int]],
) -> None:
    model = loaded(name)
    head = model.head
    assert head is not None and model.spec.head_kind is HeadKind.SEQUENCE_CLASSIFIER
    assert model.spec.num_labels == hf(name).config.num_labels
    mean = getattr(hf(name).config, "classifier_pooling", "cls") == "mean"
    for prompt, hidden in zip(prompts, run_packed(model, prompts), strict=True):
        pooled = hidden.mean(dim=0) if mean else hidden[0]
        with torch.no_grad():
            assert_close(head(pooled), _logits(hf(name), prompt))


@pytest.mark.parametrize("name", TOKEN_CLASSIFIERS)
def test_token_classifier_heads_equal_hf(
    name: str,
    loaded: Callable[[str], LoadedModel],
    hf: Callable[[str], Any],
    prompts: list[list[int]],
) -> None:
    model = loaded(name)
    head = model.head
    assert head is not None and model.spec.head_kind is HeadKind.TOKEN_CLASSIFIER
    for prompt, hidden in zip(prompts, run_packed(model, prompts), strict=True):
        with torch.no_grad():
            assert_close(head(hidden), _logits(hf(name), prompt))


@pytest.mark.parametrize("name", MASKED_LMS)
def test_masked_lm_heads_equal_hf(
    name: str,
    loaded: Callable[[str], LoadedModel],
    hf: Callable[[str], Any],
    prompts: list[list[int]],
) -> None:
    model = loaded(name)
    head = model.head
    assert head is not None and model.spec.head_kind is HeadKind.MASKED_LM
    assert model.spec.num_labels is None
    for prompt, hidden in zip(prompts, run_packed(model, prompts), strict=True):
        with torch.no_grad():
            assert_close(head(hidden), _logits(hf(name), prompt))


@pytest.mark.parametrize("name", sorted(TYPED))
def test_pair_token_types_equal_hf(
    name: str, loaded: Callable[[str], LoadedModel], hf: Callable[[str], Any]
) -> None:
    prompts = make_prompts((9, 1, 70, 33, 140), seed=3)
    # A [CLS] a [SEP] b [SEP] pair: type 0 up to the first separator, 1 after it.
    types = [[0] * (len(p) // 3) + [1] * (len(p) - len(p) // 3) for p in prompts]
    outputs = run_packed(loaded(name), prompts, types)
    untyped = run_packed(loaded(name), prompts)
    for prompt, row, ours, plain in zip(prompts, types, outputs, untyped, strict=True):
        with torch.no_grad():
            want = (
                hf(name)
                .base_model(input_ids=torch.tensor([prompt]), token_type_ids=torch.tensor([row]))
                .last_hidden_state[0]
            )
        assert_close(ours, want)
        if any(row):
            assert torch.allclose(ours, plain) is not TYPED[name]


def test_token_types_out_of_range_are_refused(loaded: Callable[[str], LoadedModel]) -> None:
    with pytest.raises(ValueError, match="token type"):
        run_packed(loaded("bert"), [[1000, 1001]], [[0, 2]])


@pytest.mark.parametrize("name", ["roberta", "mpnet"])
def test_offset_positions_skip_padding_ids_like_hf(
    name: str, loaded: Callable[[str], LoadedModel], hf: Callable[[str], Any]
) -> None:
    # A padding id inside a prompt keeps position padding_idx and is not counted, as in fairseq.
    prompts = [[1000, 1, 2000, 3000, 1, 4000], [5000, 6000], [1, 7000]]
    for prompt, ours in zip(prompts, run_packed(loaded(name), prompts), strict=True):
        with torch.no_grad():
            want = hf(name).base_model(input_ids=torch.tensor([prompt])).last_hidden_state[0]
        assert_close(ours, want)


def test_offset_positions_shorten_the_model_length(loaded: Callable[[str], LoadedModel]) -> None:
    assert loaded("roberta").spec.max_model_len == 512
    assert loaded("mpnet").spec.max_model_len == 512
    assert loaded("bert").spec.max_model_len == 512


def test_bias_path_of_the_cuda_backend_falls_back_to_the_reference() -> None:
    seq_lens = [3, 20]
    meta = build_attention_metadata(
        seq_lens_q=seq_lens,
        context_lens=[0, 0],
        write_kv=[False, False],
        block_tables=[[], []],
        block_size=16,
        device=CPU,
        causal=False,
    )
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(sum(seq_lens), 2, 8, generator=gen) for _ in range(3))
    table = torch.randn(2, 40, 40, generator=gen)

    def bias(start: int, stop: int) -> torch.Tensor:
        return table[:, : stop - start, : stop - start]

    kwargs: dict[str, Any] = {"layer": 0, "meta": meta, "kv_cache": None, "scale": 0.3}
    plain = ReferenceAttention().attend(q, k, v, sliding_window=None, **kwargs)
    biased = ReferenceAttention().attend(q, k, v, sliding_window=None, bias=bias, **kwargs)
    backend = CudaAttention(varlen=modern_varlen, device_type="cpu")
    assert_close(backend.attend(q, k, v, sliding_window=None, bias=bias, **kwargs), biased)
    assert not torch.allclose(plain, biased)


def test_every_family_class_is_supported_and_named_in_the_error(tmp_path: Path) -> None:
    supported = supported_architectures()
    for family in ENCODER_FAMILIES.values():
        for class_name in family.classes:
            assert class_name in supported
            assert hasattr(transformers, class_name), class_name
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["ElectraModel"]}))
    with pytest.raises(UnsupportedArchitectureError) as info:
        load_model(str(tmp_path), device=CPU)
    assert info.value.supported == supported
    for name in ("DebertaV2ForSequenceClassification", "ModernBertModel", "MPNetForMaskedLM"):
        assert name in str(info.value)


def test_hub_nomic_config_is_mapped_without_remote_code(
    directory: Callable[[str], Path], hf: Callable[[str], Any], tmp_path: Path
) -> None:
    hub = shutil.copytree(directory("nomicbert"), tmp_path / "hub")
    write_remote_nomic_config(hub)
    model = load_model(str(hub), device=CPU)
    assert model.spec.hidden_size == 64 and model.spec.num_layers == 2
    prompts = make_prompts((4, 90), seed=8)
    for prompt, ours in zip(prompts, run_packed(model, prompts), strict=True):
        with torch.no_grad():
            want = hf("nomicbert")(input_ids=torch.tensor([prompt])).last_hidden_state[0]
        assert_close(ours, want)


def test_hub_nomic_config_with_remote_only_switches_is_refused(
    directory: Callable[[str], Path], tmp_path: Path
) -> None:
    hub = shutil.copytree(directory("nomicbert"), tmp_path / "hub")
    write_remote_nomic_config(hub, rotary_emb_fraction=0.5, activation_function="gelu")
    with pytest.raises(ModelLoadError) as info:
        load_model(str(hub), device=CPU)
    assert "rotary_emb_fraction=0.5" in str(info.value)
    assert "activation_function='gelu'" in str(info.value)
