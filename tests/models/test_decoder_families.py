"""Gemma 1/2/3, Phi-3, Granite and bidirectional decoders equal transformers, packed and chunked."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from poolserve.models import (
    HeadKind,
    LoadedModel,
    UnsupportedArchitectureError,
    build_attention_metadata,
    load_model,
)
from poolserve.models.attention_cpu import ReferenceAttention
from poolserve.models.attention_cuda import CudaAttention
from poolserve.models.decoder_config import logits_transform
from poolserve.models.registry import DECODER_FAMILIES, supported_architectures
from tests.models.driver import (
    SHORT_PROMPT_LENGTHS,
    assert_close,
    make_prompts,
    run_chunked,
    run_whole,
)
from tests.models.test_attention import modern_varlen
from tests.tiny_decoders import TINY_DECODERS, build_hf_decoder, decoder_dirs

CPU = torch.device("cpu")
CAUSAL_BASES = ("gemma", "gemma2", "gemma3", "phi3", "granite")
BIDIRECTIONAL = ("gemma3_bidir", "qwen2_bidir")
SEQUENCE_CLASSIFIERS = ("gemma_cls", "gemma2_reward", "gemma3_cls", "phi3_cls")
TOKEN_CLASSIFIERS = ("gemma_tokcls", "gemma2_tokcls", "phi3_tokcls")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], LoadedModel]:
    """name -> the tiny checkpoint loaded by load_model() on the CPU (cached)."""
    directory = decoder_dirs(tmp_path_factory)
    return functools.cache(lambda name: load_model(str(directory(name)), device=CPU))


@pytest.fixture(scope="module")
def hf() -> Callable[[str], Any]:
    """name -> the transformers reference model (cached)."""
    return functools.cache(build_hf_decoder)


@pytest.fixture(scope="module")
def reference(
    hf: Callable[[str], Any], prompts: list[list[int]]
) -> Callable[[str], list[torch.Tensor]]:
    """name -> the reference backbone's last hidden states for every prompt (cached)."""
    cache: dict[str, list[torch.Tensor]] = {}

    def get(name: str) -> list[torch.Tensor]:
        if name not in cache:
            with torch.no_grad():
                cache[name] = [
                    hf(name).base_model(input_ids=torch.tensor([p])).last_hidden_state[0]
                    for p in prompts
                ]
        return cache[name]

    return get


@pytest.mark.parametrize("name", sorted(TINY_DECODERS))
def test_packed_batch_equals_hf(
    name: str,
    loaded: Callable[[str], LoadedModel],
    reference: Callable[[str], list[torch.Tensor]],
    prompts: list[list[int]],
) -> None:
    for ours, want in zip(run_whole(loaded(name), prompts, CPU), reference(name), strict=True):
        assert_close(ours, want)


@pytest.mark.parametrize(("name", "chunk_size"), [(n, s) for n in CAUSAL_BASES for s in (7, 64)])
def test_chunked_equals_hf(
    name: str,
    chunk_size: int,
    loaded: Callable[[str], LoadedModel],
    reference: Callable[[str], list[torch.Tensor]],
    prompts: list[list[int]],
) -> None:
    outputs = run_chunked(loaded(name), prompts, chunk_size, CPU)
    for ours, want in zip(outputs, reference(name), strict=True):
        assert_close(ours, want)


@pytest.mark.parametrize("name", CAUSAL_BASES)
def test_chunk_size_one_on_short_prompts(
    name: str,
    loaded: Callable[[str], LoadedModel],
    reference: Callable[[str], list[torch.Tensor]],
) -> None:
    # The session prompts start with these lengths and the same seed's tokens.
    short = make_prompts(SHORT_PROMPT_LENGTHS)
    outputs = run_chunked(loaded(name), short, 1, CPU, max_seqs=2)
    for ours, want in zip(outputs, reference(name), strict=False):
        assert_close(ours, want)


@pytest.mark.parametrize("name", sorted(TINY_DECODERS))
def test_only_bidirectional_decoders_are_scheduled_like_encoders(
    name: str, loaded: Callable[[str], LoadedModel]
) -> None:
    assert loaded(name).spec.is_causal is (name not in BIDIRECTIONAL)


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
    for prompt, hidden in zip(prompts, run_whole(model, prompts, CPU), strict=True):
        with torch.no_grad():
            # transformers pools the last token (no padding in these prompts).
            assert_close(head(hidden[-1]), hf(name)(input_ids=torch.tensor([prompt])).logits[0])


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
    for prompt, hidden in zip(prompts, run_whole(model, prompts, CPU), strict=True):
        with torch.no_grad():
            assert_close(head(hidden), hf(name)(input_ids=torch.tensor([prompt])).logits[0])


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "granite", "phi3"])
def test_lm_logits_transform_equals_causal_lm(
    name: str,
    loaded: Callable[[str], LoadedModel],
    hf: Callable[[str], Any],
    prompts: list[list[int]],
) -> None:
    model = hf(name)
    transform = logits_transform(model.config, DECODER_FAMILIES[model.config.model_type])
    hidden = run_whole(loaded(name), prompts[2:3], CPU)[0]
    with torch.no_grad():
        want = model(input_ids=torch.tensor(prompts[2:3])).logits[0]
        assert_close(transform(hidden @ model.lm_head.weight.T), want)


def test_every_family_class_is_supported_and_named_in_the_error(tmp_path: Path) -> None:
    supported = supported_architectures()
    for family in DECODER_FAMILIES.values():
        for class_name in family.classes:
            assert class_name in supported
            assert hasattr(transformers, class_name), class_name
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["Gemma3ForConditionalGeneration"]})
    )
    with pytest.raises(UnsupportedArchitectureError) as info:
        load_model(str(tmp_path), device=CPU)
    assert info.value.supported == supported
    assert "Gemma2ForSequenceClassification" in str(info.value)


def test_cuda_backend_windows_both_ways_and_leaves_softcap_to_the_reference() -> None:
    seq_lens = [1, 30, 9]
    meta = build_attention_metadata(
        seq_lens_q=seq_lens,
        context_lens=[0, 0, 0],
        write_kv=[False, False, False],
        block_tables=[[], [], []],
        block_size=16,
        device=CPU,
        causal=False,
    )
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(sum(seq_lens), h, 8, generator=gen) for h in (4, 2, 2))
    kwargs: dict[str, Any] = {"layer": 0, "meta": meta, "kv_cache": None, "scale": 0.3}
    backend = CudaAttention(varlen=modern_varlen, device_type="cpu")
    assert backend.can_use_varlen(q.bfloat16(), 6)
    assert not backend.can_use_varlen(q.bfloat16(), None, softcap=5.0)
    windowed = ReferenceAttention().attend(q, k, v, sliding_window=6, **kwargs)
    kernel = backend.attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), sliding_window=6, **kwargs)
    assert_close(kernel.float(), windowed, rel=2e-2)
    full = ReferenceAttention().attend(q, k, v, sliding_window=None, **kwargs)
    assert not torch.allclose(full[1:31], windowed[1:31])
