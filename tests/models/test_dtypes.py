"""Dtypes: half checkpoints run in float32 like transformers; --dtype choices and refusals."""

from __future__ import annotations

import asyncio
import typing
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open

from poolserve.config.settings import ServerSettings
from poolserve.engine.host import DTYPES, resolve_device
from poolserve.frontend.startup import start
from poolserve.frontend.state import ServiceState
from poolserve.models import load_model
from poolserve.models.loader import resolve_dtype
from poolserve.observability.metrics import ServiceMetrics
from poolserve.types.errors import UnsupportedDtypeError
from tests.models.driver import assert_close, make_prompts, run_chunked, run_whole
from tests.tiny_decoders import TINY_DECODERS, build_hf_decoder, save_tiny_decoder
from tests.tiny_encoders import TINY_ENCODERS, build_hf_encoder
from tests.tiny_models import write_tokenizer

CPU = torch.device("cpu")
CUDA = torch.device("cuda")
HALF = (torch.bfloat16, torch.float16)
# About 5x the rounding error measured on the tiny decoder; a real bug is orders larger.
HALF_TOLERANCE = {torch.bfloat16: 5e-2, torch.float16: 1e-2}
# A decoder with Gemma's float32 norm offset and bf16-rounded embedding scale, and a BERT encoder.
MODELS = {"gemma3": (TINY_DECODERS, build_hf_decoder), "bert": (TINY_ENCODERS, build_hf_encoder)}
PROMPTS = make_prompts((1, 9, 70, 200), seed=5)


def _save_half(name: str, dtype: torch.dtype, directory: Path) -> Path:
    """The tiny checkpoint stored in a half dtype, as Hub checkpoints usually are."""
    build = MODELS[name][1]
    build(name).to(dtype).save_pretrained(directory)
    write_tokenizer(directory)
    return directory


def _hf_float32(name: str, directory: Path) -> Any:
    """transformers' model read from the same files, upcast to float32."""
    hf_class = getattr(transformers, MODELS[name][0][name].hf_class)
    return hf_class.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.mark.parametrize("stored", HALF, ids=str)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_half_checkpoint_runs_in_float32_like_transformers(
    name: str, stored: torch.dtype, tmp_path: Path
) -> None:
    directory = _save_half(name, stored, tmp_path / name)
    with safe_open(str(directory / "model.safetensors"), "pt") as weights:
        assert weights.get_tensor(next(iter(weights.keys()))).dtype == stored
    loaded = load_model(str(directory), device=CPU)  # auto: float32 on the CPU
    assert loaded.spec.dtype == torch.float32
    backbone = _hf_float32(name, directory).base_model
    for prompt, ours in zip(PROMPTS, run_whole(loaded, PROMPTS, CPU), strict=True):
        assert ours.dtype == torch.float32
        with torch.no_grad():
            want = backbone(input_ids=torch.tensor([prompt])).last_hidden_state[0]
        assert_close(ours, want)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_dtypes_run_on_the_cpu(dtype: torch.dtype, tmp_path: Path) -> None:
    # torch's CPU kernels take both half types: the whole and the chunked (KV cache) paths run.
    directory = save_tiny_decoder("gemma3", tmp_path / "gemma3")
    reference = run_whole(load_model(str(directory), device=CPU), PROMPTS, CPU)
    # the tiny model's projections are too small for a half type to beat float32: run anyway
    half = load_model(str(directory), device=CPU, dtype=dtype, allow_slower_precision=True)
    assert half.spec.dtype == dtype
    for ours, want in zip(run_chunked(half, PROMPTS, 7, CPU), reference, strict=True):
        assert_close(ours, want, rel=HALF_TOLERANCE[dtype])


def test_auto_picks_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_dtype(None, CPU) == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_dtype(None, CUDA) == torch.bfloat16
    # before Ampere: no native bfloat16, so auto falls back to float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert resolve_dtype(None, CUDA) == torch.float16
    assert resolve_dtype(torch.float32, CUDA) == torch.float32


def test_bfloat16_on_a_gpu_without_it_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    with pytest.raises(UnsupportedDtypeError, match="no native bfloat16"):
        resolve_dtype(torch.bfloat16, CUDA)


def test_a_dtype_outside_the_table_is_refused() -> None:
    with pytest.raises(UnsupportedDtypeError, match="only float32, bfloat16 and float16"):
        resolve_dtype(torch.float64, CPU)


def _half_kernel_missing(*args: object, **kwargs: object) -> torch.Tensor:
    """What a CPU build without half attention kernels raises."""
    raise RuntimeError("\"attention_cpu\" not implemented for 'Half'")


def test_a_half_dtype_the_cpu_kernels_lack_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(F, "scaled_dot_product_attention", _half_kernel_missing)
    with pytest.raises(UnsupportedDtypeError, match=r"float16 cannot run on cpu: .*'Half'"):
        resolve_dtype(torch.float16, CPU)


def _start_error(settings: ServerSettings) -> str:
    """The message of the error startup fails with."""
    with pytest.raises(ValueError) as caught:
        asyncio.run(start(ServiceState(settings=settings, metrics=ServiceMetrics())))
    return str(caught.value)


def test_startup_names_the_dtype_flag(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Refused before the load: a model that does not exist is never looked for.
    model = str(tmp_path / "never-read")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    message = _start_error(ServerSettings(model=model, device="cuda", dtype="bfloat16"))
    assert message.startswith(f"model {model!r}: --dtype bfloat16: dtype bfloat16 cannot run")
    monkeypatch.setattr(F, "scaled_dot_product_attention", _half_kernel_missing)
    message = _start_error(ServerSettings(model=model, device="cpu", dtype="float16"))
    assert message.startswith(f"model {model!r}: --dtype float16: dtype float16 cannot run on cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_cuda_without_a_gpu_names_the_device_flag() -> None:
    with pytest.raises(ValueError, match="--device cuda: no CUDA device"):
        resolve_device("cuda")


def test_the_dtype_table_covers_every_flag_value() -> None:
    choices = typing.get_args(ServerSettings.model_fields["dtype"].annotation)
    assert set(DTYPES) == set(choices) and DTYPES["auto"] is None
