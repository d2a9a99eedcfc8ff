"""Fixtures of the models tests: loaded tiny models and their Hugging Face references."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
import torch

from poolserve.models import LoadedModel, load_model
from tests.models.driver import PROMPT_LENGTHS, make_prompts
from tests.tiny_models import build_hf_model

CPU = torch.device("cpu")


@pytest.fixture(scope="session")
def loaded_tiny(tiny_model_dir: Callable[[str], Path]) -> Callable[[str], LoadedModel]:
    """name -> the tiny checkpoint loaded by load_model() on the CPU (cached)."""
    cache: dict[str, LoadedModel] = {}

    def get(name: str) -> LoadedModel:
        if name not in cache:
            cache[name] = load_model(str(tiny_model_dir(name)), device=CPU)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    """Five prompts of lengths 1 .. 300."""
    return make_prompts(PROMPT_LENGTHS)


@pytest.fixture(scope="session")
def hf_tiny() -> Callable[[str], torch.nn.Module]:
    """name -> the transformers reference model of that tiny checkpoint (cached)."""
    cache: dict[str, torch.nn.Module] = {}

    def get(name: str) -> torch.nn.Module:
        if name not in cache:
            cache[name] = build_hf_model(name)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def hf_hidden(
    hf_tiny: Callable[[str], torch.nn.Module], prompts: list[list[int]]
) -> Callable[[str], list[torch.Tensor]]:
    """name -> the reference backbone's last hidden states for every prompt (cached)."""
    cache: dict[str, list[torch.Tensor]] = {}

    def get(name: str) -> list[torch.Tensor]:
        if name not in cache:
            backbone = cast(torch.nn.Module, hf_tiny(name).base_model)
            with torch.no_grad():
                cache[name] = [
                    backbone(input_ids=torch.tensor([p])).last_hidden_state[0] for p in prompts
                ]
        return cache[name]

    return get
