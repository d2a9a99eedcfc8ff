"""Loader: sharded safetensors, refusals, typed errors, sentence-transformers config, spec."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from poolserve.models import (
    HeadKind,
    LoadedModel,
    ModelLoadError,
    UnsafeCheckpointError,
    UnsupportedArchitectureError,
    load_model,
)
from tests.models.driver import assert_close, make_prompts, run_whole

CPU = torch.device("cpu")


def _copy(source: Path, target: Path) -> Path:
    """A writable copy of a checkpoint directory."""
    shutil.copytree(source, target)
    return target


def _edit_config(directory: Path, **changes: object) -> None:
    """Rewrites config.json with some keys changed."""
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def test_sharded_safetensors_load_like_the_single_file(
    tiny_model_dir: Callable[[str], Path],
    loaded_tiny: Callable[[str], LoadedModel],
    tmp_path: Path,
) -> None:
    directory = _copy(tiny_model_dir("qwen2"), tmp_path / "sharded")
    state = load_file(str(directory / "model.safetensors"))
    (directory / "model.safetensors").unlink()
    keys = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": keys[::2],
        "model-00002-of-00002.safetensors": keys[1::2],
    }
    weight_map = {}
    for filename, shard_keys in shards.items():
        save_file({k: state[k] for k in shard_keys}, str(directory / filename))
        weight_map.update(dict.fromkeys(shard_keys, filename))
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    prompts = make_prompts((3, 40))
    sharded = run_whole(load_model(str(directory), device=CPU), prompts, CPU)
    single = run_whole(loaded_tiny("qwen2"), prompts, CPU)
    for ours, reference in zip(sharded, single, strict=True):
        assert torch.equal(ours, reference)


def test_pickle_weights_are_refused(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    directory = _copy(tiny_model_dir("llama"), tmp_path / "pickled")
    state = load_file(str(directory / "model.safetensors"))
    (directory / "model.safetensors").unlink()
    torch.save(state, directory / "pytorch_model.bin")
    with pytest.raises(UnsafeCheckpointError, match="pickle"):
        load_model(str(directory), device=CPU)


def test_remote_code_is_refused(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    directory = _copy(tiny_model_dir("llama"), tmp_path / "remote")
    _edit_config(
        directory,
        architectures=["FancyForCausalLM"],
        auto_map={"AutoModelForCausalLM": "modeling_fancy.FancyForCausalLM"},
    )
    with pytest.raises(UnsafeCheckpointError, match="remote code"):
        load_model(str(directory), device=CPU)


def test_auto_map_of_a_native_architecture_is_ignored(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    directory = _copy(tiny_model_dir("qwen2_prm"), tmp_path / "prm")
    _edit_config(directory, auto_map={"AutoModel": "modeling_qwen2_rm.Qwen2ForProcessRewardModel"})
    loaded = load_model(str(directory), device=CPU)
    assert loaded.spec.head_kind is HeadKind.PROCESS_REWARD


def test_unknown_architecture_lists_supported(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    directory = _copy(tiny_model_dir("llama"), tmp_path / "unknown")
    _edit_config(directory, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedArchitectureError) as info:
        load_model(str(directory), device=CPU)
    message = str(info.value)
    for name in (
        "GPT2LMHeadModel",
        "LlamaForCausalLM",
        "Qwen3Model",
        "BertModel",
        "Qwen2ForProcessRewardModel",
        "Qwen2ForRewardModel",
    ):
        assert name in message


def test_offline_unknown_hub_id_is_a_load_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE is set"):
        load_model("no-such-org/no-such-model", device=CPU)


def test_missing_local_directory_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such folder"):
        load_model(str(tmp_path / "absent"), device=CPU)


def test_minilm_sentence_transformers_config() -> None:
    loaded = load_model(None, device=CPU)
    st = loaded.sentence_transformers
    assert st is not None
    assert st.pooling_mode == "mean" and st.normalize and st.dense is None
    assert loaded.spec.architecture == "BertModel" and loaded.spec.hidden_size == 384
    assert loaded.tokenizer("hello world")["input_ids"][0] == loaded.tokenizer.cls_token_id


def _write_dense_modules(directory: Path) -> None:
    """Adds modules.json with CLS pooling, a Tanh Dense 64 -> 16 and Normalize."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
        {
            "idx": 3,
            "name": "3",
            "path": "3_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    pooling = {
        "word_embedding_dimension": 64,
        "pooling_mode_cls_token": True,
        "pooling_mode_mean_tokens": False,
    }
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (directory / "2_Dense").mkdir()
    dense = {
        "in_features": 64,
        "out_features": 16,
        "bias": True,
        "activation_function": "torch.nn.modules.activation.Tanh",
    }
    (directory / "2_Dense" / "config.json").write_text(json.dumps(dense))
    generator = torch.Generator().manual_seed(3)
    weights = {
        "linear.weight": torch.randn(16, 64, generator=generator) * 0.3,
        "linear.bias": torch.randn(16, generator=generator) * 0.3,
    }
    save_file(weights, str(directory / "2_Dense" / "model.safetensors"))
    (directory / "3_Normalize").mkdir()


def test_dense_layer_matches_sentence_transformers(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    from sentence_transformers import SentenceTransformer

    directory = _copy(tiny_model_dir("bert"), tmp_path / "dense")
    _write_dense_modules(directory)
    loaded = load_model(str(directory), device=CPU)
    st_config = loaded.sentence_transformers
    assert st_config is not None and st_config.dense is not None
    assert st_config.pooling_mode == "cls" and st_config.normalize
    texts = ["a short sentence", "another, somewhat longer sentence about nothing much"]
    reference = SentenceTransformer(str(directory), device="cpu").encode(
        texts, convert_to_tensor=True
    )
    prompts = [loaded.tokenizer(t)["input_ids"] for t in texts]
    with torch.no_grad():
        cls = torch.stack([hidden[0] for hidden in run_whole(loaded, prompts, CPU)])
        ours = torch.nn.functional.normalize(st_config.dense(cls), dim=-1)
    assert_close(ours, reference.cpu())


def test_spec_fields(loaded_tiny: Callable[[str], LoadedModel]) -> None:
    spec = loaded_tiny("qwen3").spec
    assert (spec.architecture, spec.family, spec.is_causal) == ("Qwen3ForCausalLM", "qwen3", True)
    assert (spec.hidden_size, spec.num_layers, spec.num_kv_heads, spec.head_dim) == (64, 2, 1, 32)
    assert (spec.vocab_size, spec.max_model_len, spec.dtype) == (30522, 1024, torch.float32)
    assert spec.labels == () and not spec.supports_matryoshka
    bert = loaded_tiny("bert").spec
    assert not bert.is_causal and bert.num_kv_heads == 4 and bert.head_dim == 16


def test_matryoshka_dimensions_from_config(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    directory = _copy(tiny_model_dir("qwen3_base"), tmp_path / "matryoshka")
    _edit_config(directory, matryoshka_dimensions=[16, 32, 64])
    spec = load_model(str(directory), device=CPU).spec
    assert spec.supports_matryoshka and spec.matryoshka_dimensions == (16, 32, 64)
