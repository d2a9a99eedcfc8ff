"""Packed forwards equal the Hugging Face models prompt by prompt; heads equal HF heads."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from poolserve.models import HeadKind, LoadedModel, load_model
from tests.models.driver import assert_close, run_whole
from tests.tiny_models import reference_remote_head

CPU = torch.device("cpu")
ALL_TINY = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_base",
    "llama_cls1",
    "llama_cls3",
    "qwen2_tokcls",
    "bert",
    "qwen2_prm",
    "qwen2_rm",
)


@pytest.mark.parametrize("name", ALL_TINY)
def test_packed_hidden_states_match_hf(
    name: str,
    loaded_tiny: Callable[[str], LoadedModel],
    hf_hidden: Callable[[str], list[torch.Tensor]],
    prompts: list[list[int]],
) -> None:
    outputs = run_whole(loaded_tiny(name), prompts, CPU)
    for ours, reference in zip(outputs, hf_hidden(name), strict=True):
        assert_close(ours, reference)


def test_out_buffer_receives_hidden_states(
    loaded_tiny: Callable[[str], LoadedModel], prompts: list[list[int]]
) -> None:
    loaded = loaded_tiny("qwen2")
    from poolserve.models import build_attention_metadata

    prompt = prompts[2]
    meta = build_attention_metadata(
        seq_lens_q=[len(prompt)],
        context_lens=[0],
        write_kv=[False],
        block_tables=[[]],
        block_size=16,
        device=CPU,
        causal=True,
    )
    buffer = torch.zeros(100, loaded.spec.hidden_size)
    ids, positions = torch.tensor(prompt), torch.arange(len(prompt))
    result = loaded.model(ids, positions, meta, None, out=buffer)
    assert result.data_ptr() == buffer.data_ptr()
    assert_close(result, loaded.model(ids, positions, meta, None))


def test_minilm_matches_hf(minilm_dir: Path, prompts: list[list[int]]) -> None:
    loaded = load_model(None, device=CPU)
    assert loaded.path == minilm_dir
    assert not loaded.spec.is_causal
    hf = transformers.BertModel.from_pretrained(minilm_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        references = [hf(input_ids=torch.tensor([p])).last_hidden_state[0] for p in prompts]
    for ours, reference in zip(run_whole(loaded, prompts, CPU), references, strict=True):
        assert_close(ours, reference)


@pytest.mark.parametrize(
    ("name", "labels"),
    [
        ("llama_cls1", ("LABEL_0",)),
        ("llama_cls3", ("negative", "neutral", "positive")),
    ],
)
def test_sequence_classifier_head_matches_hf(
    name: str,
    labels: tuple[str, ...],
    loaded_tiny: Callable[[str], LoadedModel],
    hf_tiny: Callable[[str], torch.nn.Module],
    prompts: list[list[int]],
) -> None:
    loaded = loaded_tiny(name)
    assert loaded.spec.head_kind is HeadKind.SEQUENCE_CLASSIFIER
    assert loaded.spec.labels == labels and loaded.spec.num_labels == len(labels)
    head = loaded.head
    assert head is not None
    for prompt, hidden in zip(prompts, run_whole(loaded, prompts, CPU), strict=True):
        with torch.no_grad():
            reference = hf_tiny(name)(input_ids=torch.tensor([prompt])).logits[0]
            assert_close(head(hidden[-1]), reference)


def test_token_classifier_head_matches_hf(
    loaded_tiny: Callable[[str], LoadedModel],
    hf_tiny: Callable[[str], torch.nn.Module],
    prompts: list[list[int]],
) -> None:
    loaded = loaded_tiny("qwen2_tokcls")
    assert loaded.spec.head_kind is HeadKind.TOKEN_CLASSIFIER and loaded.spec.num_labels == 5
    head = loaded.head
    assert head is not None
    for prompt, hidden in zip(prompts, run_whole(loaded, prompts, CPU), strict=True):
        with torch.no_grad():
            reference = hf_tiny("qwen2_tokcls")(input_ids=torch.tensor([prompt])).logits[0]
            assert_close(head(hidden), reference)


@pytest.mark.parametrize(
    ("name", "kind", "width"),
    [
        ("qwen2_prm", HeadKind.PROCESS_REWARD, 2),
        ("qwen2_rm", HeadKind.TOKEN_REWARD, 1),
    ],
)
def test_reward_heads_match_reference(
    name: str,
    kind: HeadKind,
    width: int,
    loaded_tiny: Callable[[str], LoadedModel],
    hf_hidden: Callable[[str], list[torch.Tensor]],
    prompts: list[list[int]],
) -> None:
    loaded = loaded_tiny(name)
    assert loaded.spec.head_kind is kind and loaded.spec.num_labels == width
    head = loaded.head
    reference_head = reference_remote_head(name)
    outputs = run_whole(loaded, prompts, CPU)
    for hidden, reference_hidden in zip(outputs, hf_hidden(name), strict=True):
        with torch.no_grad():
            assert_close(head(hidden), reference_head(reference_hidden))


def test_base_models_have_no_heads(loaded_tiny: Callable[[str], LoadedModel]) -> None:
    for name in ("llama", "qwen3_base", "bert"):
        loaded = loaded_tiny(name)
        assert loaded.spec.head_kind is HeadKind.NONE and loaded.spec.num_labels is None
        assert loaded.head is None
