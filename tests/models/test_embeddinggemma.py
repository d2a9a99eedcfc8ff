"""EmbeddingGemma (bidirectional Gemma 3, mean, two Dense, Normalize) == sentence-transformers."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from poolserve.engine.loop import Engine
from poolserve.models import LoadedModel, load_model
from poolserve.types.limits import SchedulerConfig
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingTask
from tests.models.driver import assert_close
from tests.tiny_decoders import save_tiny_decoder

CPU = torch.device("cpu")
ST_MODULE = "sentence_transformers.models"
# EmbeddingGemma's head: hidden -> 4 x hidden -> output, no biases, identity activations.
DENSE_FEATURES = ((64, 256), (256, 48))
WORDS = ("the", "cat", "sat", "on", "a", "warm", "mat", "while", "rain", "fell", "outside", "and")


def write_embeddinggemma_modules(directory: Path, seed: int = 0) -> Path:
    """Adds EmbeddingGemma's sentence-transformers modules to a Gemma 3 checkpoint."""
    kinds = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Dense", "Dense")]
    kinds += [("3_Dense", "Dense"), ("4_Normalize", "Normalize")]
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"{ST_MODULE}.{kind}"}
        for i, (path, kind) in enumerate(kinds)
    ]
    (directory / "modules.json").write_text(json.dumps(modules))
    config = {"max_seq_length": 1024, "do_lower_case": False}
    (directory / "sentence_bert_config.json").write_text(json.dumps(config))
    pooling = {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}
    _write_module(directory / "1_Pooling", pooling)
    generator = torch.Generator().manual_seed(seed)
    for folder, (in_features, out_features) in zip(
        ("2_Dense", "3_Dense"), DENSE_FEATURES, strict=True
    ):
        dense = {
            "in_features": in_features,
            "out_features": out_features,
            "bias": False,
            "activation_function": "torch.nn.modules.linear.Identity",
        }
        _write_module(directory / folder, dense)
        weight = torch.randn(out_features, in_features, generator=generator) * in_features**-0.5
        save_file({"linear.weight": weight}, str(directory / folder / "model.safetensors"))
    (directory / "4_Normalize").mkdir()
    return directory


def _write_module(folder: Path, config: dict[str, Any]) -> None:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    checkpoint = save_tiny_decoder("gemma3_bidir", tmp_path_factory.mktemp("embeddinggemma"))
    return write_embeddinggemma_modules(checkpoint)


@pytest.fixture(scope="module")
def loaded(directory: Path) -> LoadedModel:
    return load_model(str(directory), device=CPU)


@pytest.fixture(scope="module")
def reference(directory: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(directory), device="cpu")


def _texts() -> list[str]:
    """Texts of 2 (no words: [CLS] [SEP]) to about 300 tokens, windows on both sides exceeded."""
    rng = random.Random(11)
    return ["", *(" ".join(rng.choices(WORDS, k=n)) for n in (1, 6, 19, 45, 130, 298))]


async def _embed(
    loaded: LoadedModel, prompts: list[list[int]], async_scheduling: bool
) -> list[torch.Tensor]:
    """Embeddings of every prompt through the engine, all submitted at once."""
    config = SchedulerConfig(
        max_num_batched_tokens=1024,
        max_num_seqs=8,
        num_kv_blocks=64,
        enable_chunked_prefill=False,  # bidirectional: scheduled whole, like an encoder
        async_scheduling=async_scheduling,
    )
    engine = Engine(loaded, config, CPU)
    engine.start()
    try:
        futures = engine.submit_many(prompts, PoolingParams(task=PoolingTask.EMBED))
        return [torch.from_numpy(output.data) for output in await asyncio.gather(*futures)]
    finally:
        await engine.stop()


def test_loads_as_a_bidirectional_embedder(loaded: LoadedModel) -> None:
    st = loaded.sentence_transformers
    assert not loaded.spec.is_causal
    assert st is not None and st.pooling_mode == "mean" and st.normalize
    assert isinstance(st.dense, torch.nn.Sequential) and len(st.dense) == 2


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_engine_equals_sentence_transformers_encode(
    loaded: LoadedModel, reference: Any, async_scheduling: bool
) -> None:
    texts = _texts()
    prompts = [loaded.tokenizer(text)["input_ids"] for text in texts]
    assert len(prompts[0]) == 2 and len(prompts[-1]) == 300
    want = reference.encode(texts, convert_to_tensor=True)  # one padded batch
    got = asyncio.run(_embed(loaded, prompts, async_scheduling))
    for ours, theirs in zip(got, want, strict=True):
        assert ours.shape == (DENSE_FEATURES[-1][1],)
        assert_close(ours, theirs)


def test_a_one_token_prompt_equals_sentence_transformers(
    loaded: LoadedModel, reference: Any
) -> None:
    # Texts always gain [CLS] and [SEP]; a single token is fed to both as ids.
    prompt = [2204]
    features = {"input_ids": torch.tensor([prompt]), "attention_mask": torch.ones(1, 1)}
    with torch.no_grad():
        want = reference(features)["sentence_embedding"][0]
    (ours,) = asyncio.run(_embed(loaded, [prompt], async_scheduling=True))
    assert_close(ours, want)
