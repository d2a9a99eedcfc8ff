"""jina-embeddings-v3 without remote code: the Hub checkpoint (XLMRobertaLoRA, task LoRA stored as
torch parametrizations) and transformers' native jina_embeddings_v3 equal transformers' model.

transformers 5.24's JinaEmbeddingsV3Model has no adapter mechanism; the remote code applies a
task's adapter as the weight W + scale x B_t @ A_t (linear) or W + scale x A_t @ B_t (tables).
So the reference of a task is transformers' model with that task's adapter merged in its weights.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from poolserve.config.settings import ServerSettings
from poolserve.engine.loop import Engine
from poolserve.http.app import create_app
from poolserve.models import load_model
from poolserve.models.adapters import AdapterSegments
from poolserve.models.attention import build_attention_metadata
from poolserve.models.spec import LoadedModel
from poolserve.types.errors import InvalidPoolingParamsError, ModelLoadError
from poolserve.types.limits import SchedulerConfig
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingTask
from tests.models.driver import BLOCK_SIZE, assert_close, make_prompts
from tests.tiny_encoders import _perturb
from tests.tiny_models import write_st_modules, write_tokenizer

CPU = torch.device("cpu")
TASKS = ("retrieval.query", "retrieval.passage", "separation", "classification", "text-matching")
RANK, ALPHA = 4, 2.0
LENGTHS = (1, 5, 37, 130, 300)
CONFIG = {
    "vocab_size": 30522,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 514,
    "type_vocab_size": 1,
    "pad_token_id": 0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 20000.0},
}
# The remote code's config fields as jinaai/jina-embeddings-v3 sets them.
REMOTE_FIELDS = {
    "architectures": ["XLMRobertaLoRA"],
    "auto_map": {
        "AutoModel": "jinaai/xlm-roberta-flash-implementation--modeling_lora.XLMRobertaLoRA"
    },
    "model_type": "xlm-roberta",
    "position_embedding_type": "rotary",
    "rotary_emb_base": 20000.0,
    "use_flash_attn": True,
    "load_trained_adapters": True,
    "lora_adaptations": list(TASKS),
    "lora_rank": RANK,
    "lora_alpha": ALPHA,
    "lora_dropout_p": 0.1,
    "lora_main_params_trainable": False,
    "emb_pooler": None,
    "matryoshka_dimensions": [16, 32, 64],
    "task_instructions": {t: f"{t}: " for t in TASKS},
}


def build_jina(seed: int = 0) -> Any:
    """A tiny random transformers JinaEmbeddingsV3Model (float32, eager, eval mode)."""
    torch.manual_seed(seed)
    config = transformers.JinaEmbeddingsV3Config(**CONFIG)
    config._attn_implementation = "eager"
    model = transformers.JinaEmbeddingsV3Model(config, add_pooling_layer=False)
    _perturb(model, seed)
    return model.eval()


def _linears(model: Any) -> dict[str, torch.Tensor]:
    """The remote code's adapted Linear weights (q, k, v fused as Wqkv), by remote name."""
    out = {}
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        prefix = f"encoder.layers.{i}."
        out[prefix + "mixer.Wqkv"] = torch.cat(
            [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
        )
        out[prefix + "mixer.out_proj"] = attn.o_proj.weight
        out[prefix + "mlp.fc1"] = layer.mlp.fc1.weight
        out[prefix + "mlp.fc2"] = layer.mlp.fc2.weight
    return out


def make_lora(model: Any, seed: int = 1) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Random stacked (A, B) per adapted module, in the remote code's shapes."""
    gen = torch.Generator().manual_seed(seed)
    lora = {}
    for name, weight in _linears(model).items():
        fan_out, fan_in = weight.shape
        a = torch.randn(len(TASKS), RANK, fan_in, generator=gen) * 0.2
        lora[name] = (a, torch.randn(len(TASKS), fan_out, RANK, generator=gen) * 0.2)
    for name in ("embeddings.word_embeddings", "embeddings.token_type_embeddings"):
        rows, dim = model.get_submodule(name).weight.shape
        a = torch.randn(len(TASKS), rows, RANK, generator=gen) * 0.2
        lora[name] = (a, torch.randn(len(TASKS), RANK, dim, generator=gen) * 0.2)
    return lora


def merged(model: Any, lora: dict[str, tuple[torch.Tensor, torch.Tensor]], task: int) -> Any:
    """transformers' model with task `task`'s adapter merged, as the remote code's weights."""
    scale = ALPHA / RANK
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name in ("embeddings.word_embeddings", "embeddings.token_type_embeddings"):
            a, b = lora[name]
            out.get_submodule(name).weight.add_(a[task] @ b[task] * scale)
        for i, layer in enumerate(out.layers):
            prefix = f"encoder.layers.{i}."
            a, b = lora[prefix + "mixer.Wqkv"]
            delta = (b[task] @ a[task] * scale).chunk(3)
            attn = layer.self_attn
            for proj, part in zip((attn.q_proj, attn.k_proj, attn.v_proj), delta, strict=True):
                proj.weight.add_(part)
            for module, name in (
                (attn.o_proj, "mixer.out_proj"),
                (layer.mlp.fc1, "mlp.fc1"),
                (layer.mlp.fc2, "mlp.fc2"),
            ):
                a, b = lora[prefix + name]
                module.weight.add_(b[task] @ a[task] * scale)
    return out


def write_remote(
    model: Any, lora: dict[str, tuple[torch.Tensor, torch.Tensor]], directory: Path
) -> Path:
    """The Hub checkpoint: remote names under `roberta.`, parametrized weights, remote config."""
    directory.mkdir(parents=True, exist_ok=True)
    weights = dict(_linears(model))
    biases = {}
    for i, layer in enumerate(model.layers):
        attn, prefix = layer.self_attn, f"encoder.layers.{i}."
        biases[prefix + "mixer.Wqkv"] = torch.cat(
            [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
        )
        biases[prefix + "mixer.out_proj"] = attn.o_proj.bias
        biases[prefix + "mlp.fc1"] = layer.mlp.fc1.bias
        biases[prefix + "mlp.fc2"] = layer.mlp.fc2.bias
        for ours, theirs in (
            ("norm1", "post_attention_layernorm"),
            ("norm2", "post_mlp_layernorm"),
        ):
            norm = getattr(layer, theirs)
            weights[prefix + ours], biases[prefix + ours] = norm.weight, norm.bias
    for name in ("embeddings.word_embeddings", "embeddings.token_type_embeddings"):
        weights[name] = model.get_submodule(name).weight
    weights["emb_ln"] = model.embeddings.LayerNorm.weight
    biases["emb_ln"] = model.embeddings.LayerNorm.bias
    state = {}
    for name, weight in weights.items():
        if name in lora:
            state[f"roberta.{name}.parametrizations.weight.original"] = weight
            a, b = lora[name]
            state[f"roberta.{name}.parametrizations.weight.0.lora_A"] = a
            state[f"roberta.{name}.parametrizations.weight.0.lora_B"] = b
        else:
            state[f"roberta.{name}.weight"] = weight
    state.update({f"roberta.{name}.bias": bias for name, bias in biases.items()})
    state = {k: v.detach().clone().contiguous() for k, v in state.items()}
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    native = model.config.to_dict()
    dropped = ("rope_parameters", "architectures", "model_type", "dtype", "transformers_version")
    config = {k: v for k, v in native.items() if k not in dropped and not k.startswith("_")}
    config.update(REMOTE_FIELDS)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(directory)
    return directory


@functools.cache
def reference() -> Any:
    return build_jina()


@functools.cache
def adapters() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return make_lora(reference())


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    directory = write_remote(reference(), adapters(), tmp_path_factory.mktemp("jina_remote"))
    return load_model(str(directory), device=CPU)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(LENGTHS, seed=5)


def run_packed(
    loaded: LoadedModel, prompts: list[list[int]], tasks: list[int | None]
) -> list[torch.Tensor]:
    """Every prompt whole in one packed forward, each with its own adapter (None: none)."""
    lengths = [len(p) for p in prompts]
    meta = build_attention_metadata(
        seq_lens_q=lengths,
        context_lens=[0] * len(prompts),
        write_kv=[False] * len(prompts),
        block_tables=[[] for _ in prompts],
        block_size=BLOCK_SIZE,
        device=CPU,
        causal=False,
    )
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lengths])
    segments = AdapterSegments.from_chunks(tasks, lengths, CPU)
    kwargs = {} if segments is None else {"adapters": segments}
    hidden = loaded.model(ids, positions, meta, None, **kwargs)
    return list(hidden.split(lengths))


def hf_hidden(model: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).last_hidden_state[0]


def test_remote_config_reads_into_the_native_family(remote: LoadedModel) -> None:
    assert (remote.spec.architecture, remote.spec.family) == ("XLMRobertaLoRA", "xlm_roberta_lora")
    assert remote.model.adapter_names == TASKS
    assert remote.spec.matryoshka_dimensions == (16, 32, 64)


def test_no_task_is_the_base_model(remote: LoadedModel, prompts: list[list[int]]) -> None:
    base = reference()
    for prompt, hidden in zip(prompts, run_packed(remote, prompts, [None] * 5), strict=True):
        assert_close(hidden, hf_hidden(base, prompt), rel=1e-5)


@pytest.mark.parametrize("task", range(len(TASKS)), ids=TASKS)
def test_each_task_equals_transformers_with_its_adapter(
    task: int, remote: LoadedModel, prompts: list[list[int]]
) -> None:
    adapted = merged(reference(), adapters(), task)
    base = reference()
    for prompt, hidden in zip(prompts, run_packed(remote, prompts, [task] * 5), strict=True):
        expected = hf_hidden(adapted, prompt)
        assert_close(hidden, expected, rel=1e-5)
        # the adapter moves the states by far more than the tolerance
        assert (expected - hf_hidden(base, prompt)).abs().max() > 1e-2 * expected.abs().max()


def test_mixed_tasks_in_one_step_equal_each_alone(
    remote: LoadedModel, prompts: list[list[int]]
) -> None:
    tasks: list[int | None] = [3, None, 0, 4, 0]
    mixed = run_packed(remote, prompts, tasks)
    for prompt, task, hidden in zip(prompts, tasks, mixed, strict=True):
        (alone,) = run_packed(remote, [prompt], [task])
        assert_close(hidden, alone, rel=1e-6)


def test_native_checkpoint_equals_transformers(tmp_path: Path, prompts: list[list[int]]) -> None:
    base = reference()
    base.save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    loaded = load_model(str(tmp_path), device=CPU)
    assert (loaded.spec.architecture, loaded.spec.family) == (
        "JinaEmbeddingsV3Model",
        "jina_embeddings_v3",
    )
    assert loaded.model.adapter_names == ()
    for prompt, hidden in zip(prompts, run_packed(loaded, prompts, [None] * 5), strict=True):
        assert_close(hidden, hf_hidden(base, prompt), rel=1e-5)


def test_remote_switches_without_a_native_twin_are_refused(tmp_path: Path) -> None:
    directory = write_remote(reference(), adapters(), tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["rotary_emb_interleaved"] = True
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="rotary_emb_interleaved=True"):
        load_model(str(directory), device=CPU)


# ---- served: the task picks the adapter (Jina's `task`, or a prompt_name that is a task) ------
PROMPTS = {
    "retrieval.query": "Represent the query for retrieving evidence documents: ",
    "retrieval.passage": "Represent the document for retrieval: ",
    "separation": "",
    "classification": "",
    "text-matching": "",
}
TEXTS = ["hello world", "a longer sentence about multilingual embeddings " * 8]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The Hub checkpoint with jina-v3's sentence-transformers files (mean pooling, prompts)."""
    directory = write_remote(reference(), adapters(), tmp_path_factory.mktemp("jina_served"))
    write_st_modules(directory, max_seq_length=None, do_lower_case=False)
    st_config = {"prompts": PROMPTS, "default_prompt_name": None}
    (directory / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    settings = ServerSettings(model=str(directory), served_model_name="jina")
    with TestClient(create_app(settings)) as client:
        yield client, AutoTokenizer.from_pretrained(str(directory))


def expected_embedding(tokenizer: Any, text: str, task: int | None) -> torch.Tensor:
    """sentence-transformers' output: the task's prompt prepended, mean-pooled, normalized."""
    model = reference() if task is None else merged(reference(), adapters(), task)
    prompt = "" if task is None else PROMPTS[TASKS[task]]
    hidden = hf_hidden(model, tokenizer(prompt + text)["input_ids"])
    return torch.nn.functional.normalize(hidden.mean(dim=0), dim=-1)


@pytest.mark.parametrize("task", [0, 1, 4, None], ids=[*[TASKS[t] for t in (0, 1, 4)], "none"])
def test_embeddings_task_field_runs_that_adapter(task: int | None, served: Any) -> None:
    client, tokenizer = served
    body: dict[str, Any] = {"input": TEXTS, "model": "jina"}
    if task is not None:
        body["task"] = TASKS[task]
    response = client.post("/v1/embeddings", json=body)
    assert response.status_code == 200, response.text
    for text, item in zip(TEXTS, response.json()["data"], strict=True):
        want = expected_embedding(tokenizer, text, task)
        assert_close(torch.tensor(item["embedding"]), want, rel=1e-5)


def test_pooling_prompt_name_that_is_a_task_runs_its_adapter(served: Any) -> None:
    client, tokenizer = served
    body = {"input": TEXTS, "model": "jina", "task": "embed", "prompt_name": "retrieval.passage"}
    response = client.post("/v1/pooling", json=body)
    assert response.status_code == 200, response.text
    for text, item in zip(TEXTS, response.json()["data"], strict=True):
        want = expected_embedding(tokenizer, text, 1)
        assert_close(torch.tensor(item["data"]), want, rel=1e-5)


def test_unknown_task_is_refused(served: Any) -> None:
    client, _ = served
    response = client.post("/v1/embeddings", json={"input": "x", "task": "summarization"})
    assert response.status_code == 400, response.text
    assert "summarization" in response.text


# ---- the engine: requests of different tasks in one step ---------------------------------------
def _engine_outputs(
    loaded: LoadedModel, batch: list[tuple[list[int], int | None]]
) -> tuple[list[np.ndarray], int]:
    """Each (prompt, task) submitted before the engine starts, so one step takes them all."""

    async def run() -> tuple[list[np.ndarray], int]:
        config = SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=16, num_kv_blocks=64)
        engine = Engine(loaded, config, CPU)
        futures = [
            engine.submit_many(
                [prompt],
                PoolingParams(PoolingTask.TOKEN_EMBED, adapter=None if t is None else TASKS[t]),
            )[0]
            for prompt, t in batch
        ]
        engine.start()
        try:
            outputs = await asyncio.gather(*futures)
        finally:
            await engine.stop()
        return [np.asarray(o.data) for o in outputs], engine.num_steps

    return asyncio.run(run())


def test_engine_runs_different_tasks_in_one_step(
    remote: LoadedModel, prompts: list[list[int]]
) -> None:
    tasks: list[int | None] = [3, None, 0, 4, 0]
    mixed, steps = _engine_outputs(remote, list(zip(prompts, tasks, strict=True)))
    assert steps == 1
    for prompt, task, output in zip(prompts, tasks, mixed, strict=True):
        (alone,), _ = _engine_outputs(remote, [(prompt, task)])
        assert_close(torch.from_numpy(output), torch.from_numpy(alone), rel=1e-6)


def test_engine_refuses_an_adapter_the_model_lacks(remote: LoadedModel) -> None:
    params = PoolingParams(PoolingTask.EMBED, adapter="summarization")
    engine = Engine(remote, SchedulerConfig(max_num_batched_tokens=1024), CPU)  # not started

    async def submit() -> None:
        engine.submit_many([[5, 6, 7]], params)

    with pytest.raises(InvalidPoolingParamsError, match="summarization"):
        asyncio.run(submit())
