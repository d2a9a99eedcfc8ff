"""Bad token ids raise InvalidTokenIdError before any attention kernel runs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from poolserve.models import (
    InvalidTokenIdError,
    LoadedModel,
    build_attention_metadata,
    validate_token_ids,
)

CPU = torch.device("cpu")
VOCAB = 30522


@pytest.mark.parametrize("bad", [[5, -1, 7], [0, VOCAB], [VOCAB + 100]])
def test_validate_token_ids_rejects_out_of_range(bad: list[int]) -> None:
    with pytest.raises(InvalidTokenIdError):
        validate_token_ids(bad, VOCAB)
    with pytest.raises(InvalidTokenIdError):
        validate_token_ids(torch.tensor(bad), VOCAB)


def test_validate_token_ids_accepts_the_range() -> None:
    validate_token_ids([0, 1, VOCAB - 1], VOCAB)
    validate_token_ids(torch.tensor([0, VOCAB - 1]), VOCAB)
    validate_token_ids([], VOCAB)


class _SpyBackend:
    """Records whether attention ran."""

    def __init__(self) -> None:
        self.calls = 0

    def attend(self, query: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        self.calls += 1
        return query


@pytest.mark.parametrize("name", ["llama", "bert"])
@pytest.mark.parametrize("bad_id", [-3, VOCAB])
def test_forward_rejects_bad_ids_before_attention(
    name: str,
    bad_id: int,
    loaded_tiny: Callable[[str], LoadedModel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loaded = loaded_tiny(name)
    spy = _SpyBackend()
    monkeypatch.setattr(loaded.model, "backend", spy)
    meta = build_attention_metadata(
        seq_lens_q=[4],
        context_lens=[0],
        write_kv=[False],
        block_tables=[[]],
        block_size=16,
        device=CPU,
        causal=loaded.spec.is_causal,
    )
    with pytest.raises(InvalidTokenIdError):
        loaded.model(torch.tensor([1, 2, bad_id, 3]), torch.arange(4), meta, None)
    assert spy.calls == 0
