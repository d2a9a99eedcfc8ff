"""PEFT LoRA adapters served per request: each adapter's outputs equal PEFT's model with that
adapter (and its merge_and_unload), alone and mixed with the base model and other adapters in
one step, on an encoder (BERT) and a decoder (Llama, chunked), async scheduling on and off, on
the layers' projections and the token embedding table;
an adapter that does not fit the model is refused with its reason, never served as the base."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from poolserve.offline import AsyncPoolingEngine
from poolserve.types.errors import InvalidPoolingParamsError, ModelStartError
from tests.tiny_encoders import build_hf_encoder, save_tiny_encoder
from tests.tiny_models import build_hf_model, save_tiny_model

# float32; the adapters' deltas are added in another order than PEFT's (segmented, after the
# fused base projection), which moves the last bits only
TOLERANCE = 1e-4
TEXTS = (
    "the quick brown fox jumps over the lazy dog",
    "a b c",
    "pack my box with five dozen liquor jugs and then some more words to make it longer",
)


def _random_adapter(base: torch.nn.Module, config: LoraConfig, seed: int) -> PeftModel:
    """`base` with a LoRA adapter whose A and B are both random (PEFT starts B at zero)."""
    model = get_peft_model(copy.deepcopy(base), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return model.eval()


# family -> (base builder, saver, the layers' module names a PEFT config targets, adapters)
ADAPTERS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "bert": [
        ("legal", {"r": 4, "lora_alpha": 8, "target_modules": ["query", "value", "output.dense"]}),
        (
            "medical",
            {
                "r": 8,
                "lora_alpha": 4,
                "use_rslora": True,
                "target_modules": [
                    "query",
                    "key",
                    "value",
                    "intermediate.dense",
                    "word_embeddings",
                ],
                "alpha_pattern": {"key": 2},
            },
        ),
        ("finance", {"r": 2, "lora_alpha": 2, "target_modules": ["key", "attention.output.dense"]}),
    ],
    "llama": [
        ("legal", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}),
        (
            "medical",
            {
                "r": 8,
                "lora_alpha": 16,
                "target_modules": ["k_proj", "o_proj", "gate_proj", "up_proj", "embed_tokens"],
            },
        ),
        ("finance", {"r": 2, "lora_alpha": 2, "target_modules": ["q_proj", "up_proj"]}),
    ],
}


def _states(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    """The backbone's last hidden states of one prompt: what token_embed returns unnormalized
    (a PEFT model's backbone carries its LoRA layers)."""
    hf = model.get_base_model() if isinstance(model, PeftModel) else model
    with torch.no_grad():
        return hf.base_model(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()


class Served:
    """A tiny base model, its adapters saved as PEFT folders, and their reference models."""

    def __init__(self, family: str, directory: Path) -> None:
        self.family = family
        if family == "bert":
            base = build_hf_encoder("bert")
            self.path = save_tiny_encoder("bert", directory / "base", base)
        else:
            base = build_hf_model("llama")
            self.path = save_tiny_model("llama", directory / "base")
        self.base = base
        self.references: dict[str, torch.nn.Module] = {"base": base}
        self.folders: dict[str, Path] = {}
        for seed, (name, options) in enumerate(ADAPTERS[family]):
            adapted = _random_adapter(base, LoraConfig(**options), seed)
            folder = directory / name
            adapted.save_pretrained(folder)
            self.folders[name] = folder
            self.references[name] = adapted

    def lora_modules(self) -> list[str]:
        return [f"{name}={folder}" for name, folder in self.folders.items()]


@pytest.fixture(scope="module", params=["bert", "llama"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Served:
    return Served(request.param, tmp_path_factory.mktemp(f"lora-{request.param}"))


def _run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


async def _token_states(
    engine: AsyncPoolingEngine, names: list[str], texts: tuple[str, ...]
) -> dict[str, list[np.ndarray]]:
    """Every text's token states under each name (base: the model), all submitted at once."""

    async def one(name: str) -> list[np.ndarray]:
        model = None if name == "base" else name
        pooled = await engine.encode(list(texts), "token_embed", normalize=False, model=model)
        return [np.asarray(p.data) for p in pooled]

    results = await asyncio.gather(*(one(name) for name in names))
    return dict(zip(names, results, strict=True))


def _token_ids(engine: AsyncPoolingEngine, text: str) -> list[int]:
    return list(engine.state.model.tokenizer(text)["input_ids"])  # type: ignore[union-attr]


def _close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = max(1.0, float(np.abs(want).max()))
    assert float(np.abs(got - want).max()) <= TOLERANCE * scale


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_adapters_alone_and_mixed_equal_peft(served: Served, async_scheduling: bool) -> None:
    """Base + three adapters in one submission wave (several per step; the decoder chunked):
    each output equals PEFT's model with that adapter, and each adapter moves every output."""
    names = ["base", *served.folders]
    settings: dict[str, Any] = {
        "lora_modules": served.lora_modules(),
        "max_loras": 3,
        "max_lora_rank": 8,
        "async_scheduling": async_scheduling,
        "max_num_seqs": 8,
    }
    if served.family == "llama":  # a step budget under the long prompt: chunked prefill
        settings["max_num_batched_tokens"] = 16
        settings["max_model_len"] = 64

    async def run() -> tuple[dict[str, list[np.ndarray]], list[list[int]]]:
        async with AsyncPoolingEngine(str(served.path), **settings) as engine:
            ids = [_token_ids(engine, text) for text in TEXTS]
            return await _token_states(engine, names, TEXTS), ids

    got, ids = _run(run())
    for name in names:
        reference = served.references[name]
        for index, token_ids in enumerate(ids):
            _close(got[name][index], _states(reference, token_ids))
    for name in served.folders:  # no silent fallback: every adapter changes every text
        for index in range(len(TEXTS)):
            assert float(np.abs(got[name][index] - got["base"][index]).max()) > 1e-2


def test_adapter_equals_merged_weights(served: Served) -> None:
    """PEFT's merge_and_unload of an adapter: the same states as the adapter served unmerged."""
    name = next(iter(served.folders))
    merged = copy.deepcopy(served.references[name]).merge_and_unload().eval()  # type: ignore[operator]

    async def run() -> tuple[list[np.ndarray], list[list[int]]]:
        async with AsyncPoolingEngine(
            str(served.path), lora_modules=served.lora_modules(), max_lora_rank=8
        ) as engine:
            ids = [_token_ids(engine, text) for text in TEXTS]
            return (await _token_states(engine, [name], TEXTS))[name], ids

    got, ids = _run(run())
    for index, token_ids in enumerate(ids):
        _close(got[index], _states(merged, token_ids))


def test_more_adapters_than_slots_take_turns(served: Served) -> None:
    """Two adapters, one slot: each request's adapter is written in when its turn comes (the
    idle one evicted), and every answer is still its own adapter's."""
    order = [*served.folders, *served.folders]  # each adapter twice, in turn

    async def run() -> tuple[list[np.ndarray], list[int], int]:
        async with AsyncPoolingEngine(
            str(served.path), lora_modules=served.lora_modules(), max_loras=1, max_lora_rank=8
        ) as engine:
            ids = _token_ids(engine, TEXTS[0])
            got = []
            for name in order:
                pooled = await engine.encode([TEXTS[0]], "token_embed", normalize=False, model=name)
                got.append(np.asarray(pooled[0].data))
            slots = engine.state.core.engine.adapters  # type: ignore[union-attr]
            return got, ids, slots.evictions

    got, ids, evictions = _run(run())
    for name, states in zip(order, got, strict=True):
        _close(states, _states(served.references[name], ids))
    assert evictions == len(order) - 1


def _edit_config(folder: Path, tmp: Path, **changes: Any) -> Path:
    """A copy of the adapter folder with adapter_config.json changed."""
    copied = tmp / f"edited-{len(list(tmp.iterdir()))}"
    copied.mkdir()
    for file in folder.iterdir():
        (copied / file.name).write_bytes(file.read_bytes())
    config = json.loads((copied / "adapter_config.json").read_text())
    config.update(changes)
    (copied / "adapter_config.json").write_text(json.dumps(config))
    return copied


REFUSALS: dict[str, tuple[Callable[[Served, Path], list[str]], dict[str, Any], str]] = {
    "rank above the limit": (lambda s, t: s.lora_modules(), {"max_lora_rank": 4}, "above"),
    "DoRA": (
        lambda s, t: [f"x={_edit_config(next(iter(s.folders.values())), t, use_dora=True)}"],
        {},
        "use_dora",
    ),
    "not a folder": (lambda s, t: [f"x={t / 'missing'}"], {}, "x"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_adapters_that_do_not_fit_are_refused(served: Served, tmp_path: Path, case: str) -> None:
    """Each refusal names its reason; the model does not start on the base weights instead."""
    modules, extra, words = REFUSALS[case]
    settings = {"lora_modules": modules(served, tmp_path), "max_lora_rank": 8, **extra}

    async def run() -> None:
        async with AsyncPoolingEngine(str(served.path), **settings):
            pass

    with pytest.raises(ModelStartError) as raised:  # it wraps the load error's message
        _run(run())
    assert words in str(raised.value), str(raised.value)


def test_a_module_the_model_lacks_is_refused(served: Served, tmp_path: Path) -> None:
    """An adapter trained on another architecture's modules names the first it cannot place."""
    other = "llama" if served.family == "bert" else "bert"
    base = build_hf_encoder("bert") if other == "bert" else build_hf_model("llama")
    target = ADAPTERS[other][0][1]
    folder = tmp_path / "foreign"
    _random_adapter(base, LoraConfig(**target), 0).save_pretrained(folder)

    async def run() -> None:
        async with AsyncPoolingEngine(
            str(served.path), lora_modules=[f"foreign={folder}"], max_lora_rank=8
        ):
            pass

    with pytest.raises(ModelStartError) as raised:
        _run(run())
    assert "LoRA adapter 'foreign'" in str(raised.value), str(raised.value)


def test_unload_waits_for_the_requests_holding_the_adapter(served: Served) -> None:
    """An unload refuses the adapter's new requests at once and clears its slot only when the
    last admitted request holding it is done."""

    async def run() -> None:
        async with AsyncPoolingEngine(
            str(served.path), lora_modules=served.lora_modules(), max_lora_rank=8
        ) as offline:
            engine = offline.state.core.engine  # type: ignore[union-attr]
            name = next(iter(served.folders))
            index = engine.adapters.acquire(name)  # as an admitted request holds it
            unload = asyncio.create_task(engine.unload_adapter(name))
            await asyncio.sleep(0.05)
            assert not unload.done()
            assert name not in [m.name for m in engine.adapters.modules]
            with pytest.raises(InvalidPoolingParamsError):
                engine.adapters.acquire(name)
            assert engine.loaded.model.adapter_names[index] == name  # still running
            engine.adapters.release(index)
            await asyncio.wait_for(unload, 5)
            assert engine.loaded.model.adapter_names[index] == ""

    _run(run())


@pytest.mark.parametrize("family", ["bert_cls", "llama_cls3"])
def test_a_classifier_adapter_with_its_own_head(family: str, tmp_path: Path) -> None:
    """An adapter that trains the classifier too (`modules_to_save`, and LoRA on the head's
    own Linears, merged there): its logits equal PEFT's, the base model's stay the base's."""
    if family == "bert_cls":
        base = build_hf_encoder(family)
        path = save_tiny_encoder(family, tmp_path / "base", base)
        targets = ["query", "value", "pooler.dense"]
        saved = ["classifier"]
    else:
        base = build_hf_model(family)
        path = save_tiny_model(family, tmp_path / "base")
        targets = ["q_proj", "v_proj", "down_proj"]
        saved = ["score"]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, modules_to_save=saved)
    adapted = _random_adapter(base, config, 5)
    with torch.no_grad():  # PEFT copies the head: give the copy its own weights
        for name, param in adapted.named_parameters():
            if "modules_to_save" in name:
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(9)))
    adapted.save_pretrained(tmp_path / "tuned")

    async def run() -> tuple[dict[str, list[np.ndarray]], list[list[int]]]:
        async with AsyncPoolingEngine(
            str(path), lora_modules=[f"tuned={tmp_path / 'tuned'}"], max_lora_rank=4
        ) as engine:
            ids = [_token_ids(engine, text) for text in TEXTS]

            async def logits(model: str | None) -> list[np.ndarray]:
                pooled = await engine.encode(
                    list(TEXTS), "classify", use_activation=False, model=model
                )
                return [np.asarray(p.data) for p in pooled]

            base_out, tuned_out = await asyncio.gather(logits(None), logits("tuned"))
            return {"base": base_out, "tuned": tuned_out}, ids

    got, ids = _run(run())
    assert float(np.abs(got["tuned"][0] - got["base"][0]).max()) > 1e-2  # its own head ran
    for name, model in (("base", base), ("tuned", adapted)):
        for index, token_ids in enumerate(ids):
            with torch.no_grad():
                want = model(input_ids=torch.tensor([token_ids])).logits[0].numpy()
            _close(got[name][index], want)


def test_an_adapter_that_replaces_the_embedding_table_is_refused(
    served: Served, tmp_path: Path
) -> None:
    """PEFT saves the adapted table beside its embedding LoRA; a table other than the model's
    would change every token's row, which is not served."""
    from safetensors.torch import load_file, save_file

    name, folder = list(served.folders.items())[1]  # the adapter that trains the table
    copied = tmp_path / "changed"
    copied.mkdir()
    (copied / "adapter_config.json").write_bytes((folder / "adapter_config.json").read_bytes())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    (lora_a,) = [k for k in tensors if k.endswith(".lora_embedding_A")]
    (table,) = [
        v
        for k, v in served.base.state_dict().items()
        if k.endswith(("word_embeddings.weight", "embed_tokens.weight"))
    ]
    tensors[lora_a.removesuffix("lora_embedding_A") + "base_layer.weight"] = table + 1.0
    save_file(tensors, str(copied / "adapter_model.safetensors"))

    async def run() -> None:
        async with AsyncPoolingEngine(
            str(served.path), lora_modules=[f"{name}={copied}"], max_lora_rank=8
        ):
            pass

    with pytest.raises(ModelStartError) as raised:
        _run(run())
    assert "replaces the embedding table" in str(raised.value), str(raised.value)


def test_prefix_caching_never_serves_an_adapter_from_another_adapters_blocks(
    tmp_path: Path,
) -> None:
    """A decoder pooling its last token shares cached prefix blocks; the same long prompt under
    the base model, then an adapter, then another: each equals its own model (a block cached
    by one is never read by another), and the base still hits its own cache."""
    served = Served("llama", tmp_path)
    text = " ".join(TEXTS * 3)  # several KV blocks long

    async def run() -> tuple[dict[str, np.ndarray], list[int], int]:
        async with AsyncPoolingEngine(
            str(served.path), lora_modules=served.lora_modules(), max_lora_rank=8, block_size=4
        ) as engine:
            ids = _token_ids(engine, text)
            got = {}
            for name in ["base", *served.folders, "base"]:
                model = None if name == "base" else name
                pooled = await engine.encode([text], "embed", normalize=False, model=model)
                got[name] = np.asarray(pooled[0].data)
            snapshot = engine.state.core.engine.snapshot()  # type: ignore[union-attr]
            hits = snapshot.prefix_cache_hit_tokens
            return got, ids, hits

    got, ids, hits = _run(run())
    for name, states in got.items():
        _close(states, _states(served.references[name], ids)[-1])  # the last token's state
    assert hits > 0
