"""GTE without remote code: Hub "NewModel" checkpoints (model_type "new") equal transformers' gte.

The Hub checkpoints (gte-multilingual-base, gte-base-en-v1.5, gte-multilingual-reranker-base)
are written here from transformers' own GTE: the tensor names it saves under `new.`, and the
remote code's config.json (auto_map, rope_theta, rope_scaling, pack_qkv, ...).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app
from poolserve.models import HeadKind, ModelLoadError, load_model
from poolserve.models.rope import Rotary
from tests.models.driver import assert_close, make_prompts
from tests.models.test_encoder_families import run_packed
from tests.tiny_encoders import TINY_ENCODERS, _perturb, save_tiny_encoder
from tests.tiny_rerankers import write_xlmr_layout_tokenizer

CPU = torch.device("cpu")
REMOTE = "Alibaba-NLP/new-impl--modeling.NewModel"
# The remote code's switches as the Hub configs set them (gte-base-en-v1.5).
REMOTE_SWITCHES = {
    "position_embedding_type": "rope",
    "layer_norm_type": "layer_norm",
    "pack_qkv": True,
    "unpad_inputs": False,
    "use_memory_efficient_attention": False,
    "logn_attention_scale": False,
    "logn_attention_clip1": False,
}
# Several lengths batched together; 300 tokens reach far into the rotary table.
LENGTHS = (1, 5, 37, 130, 300)
NTK = {"type": "ntk", "factor": 2.0}


def build_gte(name: str, seed: int = 0, **overrides: Any) -> Any:
    """The named tiny GTE (gte, gte_cls, gte_mlm) with config overrides, eager, eval mode."""
    spec = TINY_ENCODERS[name]
    torch.manual_seed(seed)
    config = transformers.GteConfig(**{**spec.config, **overrides})
    config._attn_implementation = "eager"
    model = getattr(transformers, spec.hf_class)(config)
    _perturb(model, seed)
    return model.eval()


def write_hub_layout(
    model: Any, directory: Path, rope_scaling: dict[str, Any] | None = None, **extra: Any
) -> Path:
    """Saves `model`, then rewrites it as a Hub GTE checkpoint: `new.` tensors, remote config."""
    save_tiny_encoder("gte", directory, model)
    weights = directory / "model.safetensors"
    state = {
        ("new." + key.removeprefix("gte.") if key.startswith("gte.") else key): value
        for key, value in load_file(weights).items()
    }
    save_file(state, weights, metadata={"format": "pt"})
    native = json.loads((directory / "config.json").read_text())
    base = native["rope_parameters"]["rope_theta"]
    dropped = ("rope_parameters", "model_type", "architectures", "dtype", "transformers_version")
    remote = {k: v for k, v in native.items() if k not in dropped}
    remote.update(
        architectures=[native["architectures"][0].replace("Gte", "New")],
        auto_map={"AutoModel": REMOTE, "AutoModelForSequenceClassification": REMOTE},
        model_type="new",
        rope_theta=base if rope_scaling is None else base / rope_scaling["factor"],
        rope_scaling=rope_scaling,
        **REMOTE_SWITCHES,
    )
    remote.update(extra)
    (directory / "config.json").write_text(json.dumps(remote, indent=2))
    return directory


def remote_ntk_inv_freq(theta: float, factor: float, dim: int) -> torch.Tensor:
    """The remote code's NTKScalingRotaryEmbedding table frequencies, as it computes them."""
    base = theta * factor
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
    return inv_freq / factor ** (2 / dim)


def ntk_as_linear(theta: float, factor: float, dim: int) -> dict[str, Any]:
    """transformers' rope parameters of the remote NTK rope of base `theta`."""
    return {"rope_type": "linear", "rope_theta": theta * factor, "factor": factor ** (2 / dim)}


@pytest.fixture(scope="module")
def hf() -> Callable[[str], Any]:
    return functools.cache(build_gte)


@pytest.fixture(scope="module")
def hub(
    tmp_path_factory: pytest.TempPathFactory, hf: Callable[[str], Any]
) -> Callable[[str], Path]:
    """name -> a Hub-layout copy of that tiny GTE (cached)."""

    @functools.cache
    def get(name: str) -> Path:
        return write_hub_layout(hf(name), tmp_path_factory.mktemp(f"hub_{name}"))

    return get


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(LENGTHS, seed=11)


def _hidden(model: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.base_model(input_ids=torch.tensor([prompt])).last_hidden_state[0]


def _logits(model: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).logits[0]


@pytest.mark.parametrize(
    ("name", "architecture", "head_kind"),
    [
        ("gte", "NewModel", HeadKind.NONE),
        ("gte_cls", "NewForSequenceClassification", HeadKind.SEQUENCE_CLASSIFIER),
        ("gte_tokcls", "NewForTokenClassification", HeadKind.TOKEN_CLASSIFIER),
        ("gte_mlm", "NewForMaskedLM", HeadKind.MASKED_LM),
    ],
)
def test_hub_checkpoint_loads_without_remote_code_and_equals_hf(
    name: str,
    architecture: str,
    head_kind: HeadKind,
    hub: Callable[[str], Path],
    hf: Callable[[str], Any],
    prompts: list[list[int]],
) -> None:
    model = load_model(str(hub(name)), device=CPU)
    assert (model.spec.architecture, model.spec.family) == (architecture, "new")
    assert model.spec.head_kind is head_kind and not model.spec.is_causal
    for prompt, hidden in zip(prompts, run_packed(model, prompts), strict=True):
        assert_close(hidden, _hidden(hf(name), prompt))
        if model.head is None:
            continue
        pooled = hidden[0] if head_kind is HeadKind.SEQUENCE_CLASSIFIER else hidden
        with torch.no_grad():
            assert_close(model.head(pooled), _logits(hf(name), prompt))


def test_transformers_reads_the_hub_layout_as_written(
    hub: Callable[[str], Path], hf: Callable[[str], Any], prompts: list[list[int]]
) -> None:
    """Our Hub copy is what transformers' conversion mapping reads: `new.` stripped, fused split."""
    reference = hf("gte_cls")
    again = transformers.GteForSequenceClassification.from_pretrained(
        str(hub("gte_cls")), config=reference.config, attn_implementation="eager"
    ).eval()
    for prompt in prompts:
        # the same weights; split views of the fused tensors may take another GEMM path, whose
        # float32 sums round differently (1.1e-6 of the scale on an AVX-512 CPU, less on AVX2):
        # a layout read wrong would be off by the scale itself
        assert_close(_logits(again, prompt), _logits(reference, prompt), rel=1e-5)


def test_native_and_hub_layouts_give_the_same_states(
    tmp_path: Path, hub: Callable[[str], Path], hf: Callable[[str], Any], prompts: list[list[int]]
) -> None:
    native = load_model(str(save_tiny_encoder("gte_cls", tmp_path, hf("gte_cls"))), device=CPU)
    assert (native.spec.architecture, native.spec.family) == ("GteForSequenceClassification", "gte")
    remote = load_model(str(hub("gte_cls")), device=CPU)
    for ours, theirs in zip(run_packed(native, prompts), run_packed(remote, prompts), strict=True):
        assert torch.equal(ours, theirs)


def test_ntk_rope_scaling_is_the_remote_codes(tmp_path: Path, prompts: list[list[int]]) -> None:
    # gte-base-en-v1.5 / gte-large-en-v1.5: rope_scaling {"type": "ntk", "factor": 2.0}
    theta, dim = 1000.0, 64 // 4
    reference = build_gte("gte", rope_parameters=ntk_as_linear(theta, NTK["factor"], dim))
    directory = write_hub_layout(reference, tmp_path, rope_scaling=NTK)
    assert json.loads((directory / "config.json").read_text())["rope_theta"] == theta
    model = load_model(str(directory), device=CPU)
    (rotary,) = [m for m in model.model.modules() if isinstance(m, Rotary)]
    assert torch.equal(rotary.inv_freq, remote_ntk_inv_freq(theta, NTK["factor"], dim))
    for prompt, hidden in zip(prompts, run_packed(model, prompts), strict=True):
        assert_close(hidden, _hidden(reference, prompt))


def test_no_token_type_table_like_gte_base_en(tmp_path: Path, prompts: list[list[int]]) -> None:
    # gte-base-en-v1.5 sets type_vocab_size 0: no token type embeddings at all
    reference = build_gte("gte", type_vocab_size=0)
    assert reference.embeddings.token_type_embeddings is None
    model = load_model(str(write_hub_layout(reference, tmp_path)), device=CPU)
    assert model.model.num_token_types == 0
    for prompt, hidden in zip(prompts, run_packed(model, prompts), strict=True):
        assert_close(hidden, _hidden(reference, prompt))


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"layer_norm_type": "rms_norm"}, "layer_norm_type='rms_norm'"),
        ({"logn_attention_scale": True, "pack_qkv": False}, "logn_attention_scale=True"),
        ({"position_embedding_type": "absolute"}, "position_embedding_type='absolute'"),
        ({"rope_scaling": {**NTK, "mixed_b": 0.8}}, "mixed_b"),
        ({"rope_scaling": {"type": "yarn", "factor": 2.0}}, "yarn"),
    ],
)
def test_remote_only_switches_are_refused_by_name(
    extra: dict[str, Any], named: str, hub: Callable[[str], Path], tmp_path: Path
) -> None:
    config = json.loads((hub("gte") / "config.json").read_text())
    for filename in ("config.json", "model.safetensors"):
        (tmp_path / filename).write_bytes((hub("gte") / filename).read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({**config, **extra}))
    with pytest.raises(ModelLoadError, match="needs remote code") as info:
        load_model(str(tmp_path), device=CPU)
    assert named in str(info.value)
    if "pack_qkv" in extra:
        assert "pack_qkv=False" in str(info.value)


def write_st_pooling(directory: Path, mode: str) -> Path:
    """sentence-transformers modules: Transformer, Pooling (`cls` or `mean`), Normalize."""
    kinds = (("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize"))
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (path, kind) in enumerate(kinds)
    ]
    (directory / "modules.json").write_text(json.dumps(modules))
    for folder in ("1_Pooling", "2_Normalize"):
        (directory / folder).mkdir(exist_ok=True)
    hidden = json.loads((directory / "config.json").read_text())["hidden_size"]
    pooling = {"word_embedding_dimension": hidden, f"pooling_mode_{mode}_token": True}
    if mode == "mean":
        pooling = {"word_embedding_dimension": hidden, "pooling_mode_mean_tokens": True}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))
    return directory


@pytest.fixture
def serve() -> Callable[[Path], Any]:
    def make(directory: Path) -> TestClient:
        settings = ServerSettings(model=str(directory), served_model_name="gte")
        return TestClient(create_app(settings))

    return make


TEXTS = ["hello world", "x", "a longer sentence about multilingual embeddings " * 12]


@pytest.mark.parametrize(("layout", "mode"), [("hub", "cls"), ("native", "mean")])
def test_embeddings_route_pools_as_the_st_config_says(
    layout: str, mode: str, tmp_path: Path, serve: Callable[[Path], Any]
) -> None:
    reference = build_gte("gte", seed=3)
    if layout == "hub":
        directory = write_hub_layout(reference, tmp_path)
    else:
        directory = save_tiny_encoder("gte", tmp_path, reference)
    write_st_pooling(directory, mode)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    with serve(directory) as client:
        response = client.post("/v1/embeddings", json={"input": TEXTS, "model": "gte"})
    assert response.status_code == 200, response.text
    for text, item in zip(TEXTS, response.json()["data"], strict=True):
        hidden = _hidden(reference, tokenizer(text)["input_ids"])
        pooled = hidden[0] if mode == "cls" else hidden.mean(dim=0)
        assert_close(torch.tensor(item["embedding"]), F.normalize(pooled, dim=-1))


QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "a recipe for bread " * 10, "berlin"]


def test_reranker_route_scores_equal_hf(tmp_path: Path, serve: Callable[[Path], Any]) -> None:
    # gte-multilingual-reranker-base: NewForSequenceClassification, one label, XLM-R pairs
    reference = build_gte("gte_cls", seed=5, num_labels=1)
    directory = write_hub_layout(reference, tmp_path)
    write_xlmr_layout_tokenizer(directory)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    with serve(directory) as client:
        raw = client.post(
            "/rerank", json={"query": QUERY, "documents": DOCUMENTS, "use_activation": False}
        )
        scored = client.post("/score", json={"text_1": QUERY, "text_2": DOCUMENTS})
    assert raw.status_code == 200, raw.text
    assert scored.status_code == 200, scored.text
    logits = {r["index"]: r["relevance_score"] for r in raw.json()["results"]}
    scores = [item["score"] for item in scored.json()["data"]]
    for i, document in enumerate(DOCUMENTS):
        pair = tokenizer(QUERY, document)
        assert "token_type_ids" not in pair
        want = _logits(reference, pair["input_ids"])
        assert_close(torch.tensor([logits[i]]), want)
        assert_close(torch.tensor([scores[i]]), torch.sigmoid(want))
