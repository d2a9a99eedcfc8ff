"""Task gating by the model's heads, the task table, and parameter validation."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch
from torch import nn

from poolserve.pooling import (
    SUPPORTED_TASKS,
    CloneStats,
    InvalidPoolingParamsError,
    PoolingConfigError,
    PoolingModelInfo,
    PoolingParams,
    PoolingTask,
    PoolingType,
    UnsupportedTaskError,
    build_pooler,
    get_supported_tasks,
    validate_params,
)
from poolserve.types.tasks import PUBLIC_TASKS
from tests.tiny_models import build_hf_model

T = PoolingTask
HIDDEN = 64


def test_task_values_are_the_wire_names() -> None:
    # what clients may name; bge-m3's combined outputs are the server's own (its score routes)
    assert {t.value for t in PoolingTask} - {t.value for t in PUBLIC_TASKS} == {"embed_m3"}
    assert {t.value for t in PUBLIC_TASKS} == {
        "embed",
        "classify",
        "token_embed",
        "token_classify",
        "embed&token_classify",
        "reward",
        "score",
        "embed_sparse",
    }
    assert frozenset(PoolingTask) == SUPPORTED_TASKS
    assert PoolingParams(task=T.EMBED_TOKEN_CLASSIFY).is_token_level
    assert PoolingParams(task=T.TOKEN_EMBED).is_token_level
    assert not PoolingParams(task=T.EMBED).is_token_level


@cache
def _hf(name: str) -> Any:
    """The transformers model, built once per test session (its heads are only read)."""
    return build_hf_model(name)


def _decoder_base() -> PoolingModelInfo:
    hf = _hf("llama")
    return PoolingModelInfo(is_decoder=True, hidden_size=hf.config.hidden_size)


def _decoder_token_classifier() -> PoolingModelInfo:
    hf = _hf("qwen2_tokcls")
    return PoolingModelInfo(
        is_decoder=True,
        hidden_size=hf.config.hidden_size,
        token_classifier=hf.score,
        num_labels=hf.config.num_labels,
    )


def _seq_classifier(num_labels: int) -> PoolingModelInfo:
    return PoolingModelInfo(
        is_decoder=True,
        hidden_size=HIDDEN,
        seq_classifier=nn.Linear(HIDDEN, num_labels, bias=False),
        num_labels=num_labels,
    )


def _prm() -> PoolingModelInfo:
    head = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 2))
    return PoolingModelInfo(
        is_decoder=True, hidden_size=HIDDEN, process_reward_head=head, num_labels=2
    )


def _matryoshka(dims: tuple[int, ...] | None) -> PoolingModelInfo:
    return PoolingModelInfo(
        is_decoder=True, hidden_size=HIDDEN, supports_matryoshka=True, matryoshka_dimensions=dims
    )


def test_decoder_base_model_supports_embed_and_token_embed() -> None:
    assert get_supported_tasks(_decoder_base()) == {T.EMBED, T.TOKEN_EMBED}


def test_decoder_token_classifier_supports_token_tasks() -> None:
    # No encoder-only filtering: a decoder *ForTokenClassification serves token_classify.
    assert get_supported_tasks(_decoder_token_classifier()) == {
        T.TOKEN_CLASSIFY,
        T.EMBED_TOKEN_CLASSIFY,
    }


def test_encoder_models_are_gated_by_heads_only() -> None:
    encoder = PoolingModelInfo(is_decoder=False, hidden_size=HIDDEN)
    assert get_supported_tasks(encoder) == {T.EMBED, T.TOKEN_EMBED}
    tagger = PoolingModelInfo(
        is_decoder=False, hidden_size=HIDDEN, token_classifier=nn.Linear(HIDDEN, 4), num_labels=4
    )
    assert get_supported_tasks(tagger) == {T.TOKEN_CLASSIFY, T.EMBED_TOKEN_CLASSIFY}


def test_head_table() -> None:
    assert get_supported_tasks(_seq_classifier(3)) == {T.CLASSIFY}
    assert get_supported_tasks(_seq_classifier(1)) == {T.CLASSIFY, T.REWARD, T.SCORE}
    assert get_supported_tasks(_prm()) == {T.REWARD}
    rm = PoolingModelInfo(
        is_decoder=True, hidden_size=HIDDEN, token_reward_head=nn.Linear(HIDDEN, 1), num_labels=1
    )
    assert get_supported_tasks(rm) == {T.REWARD}


@pytest.mark.parametrize("task", [T.CLASSIFY, T.TOKEN_CLASSIFY, T.EMBED_TOKEN_CLASSIFY, T.REWARD])
def test_unsupported_task_names_the_supported_ones(task: PoolingTask) -> None:
    with pytest.raises(UnsupportedTaskError) as caught:
        build_pooler(
            _decoder_base(), PoolingParams(task=task), async_scheduling=False, stats=CloneStats()
        )
    assert caught.value.task == task.value
    assert caught.value.supported == ("embed", "token_embed")
    assert "embed, token_embed" in str(caught.value)


def test_token_classifier_refuses_embed() -> None:
    with pytest.raises(UnsupportedTaskError) as caught:
        validate_params(_decoder_token_classifier(), PoolingParams(task=T.EMBED))
    assert caught.value.supported == ("embed&token_classify", "token_classify")


@pytest.mark.parametrize(
    ("info", "params", "field"),
    [
        (_matryoshka(None), PoolingParams(T.EMBED, dimensions=HIDDEN + 1), "dimensions"),
        (_matryoshka(None), PoolingParams(T.EMBED, dimensions=0), "dimensions"),
        (_matryoshka(None), PoolingParams(T.EMBED, dimensions=-3), "dimensions"),
        (_matryoshka((16, 32)), PoolingParams(T.EMBED, dimensions=24), "dimensions"),
        (
            PoolingModelInfo(is_decoder=True, hidden_size=HIDDEN),
            PoolingParams(T.EMBED, dimensions=16),
            "dimensions",
        ),
        (_seq_classifier(3), PoolingParams(T.CLASSIFY, dimensions=16), "dimensions"),
        (_seq_classifier(3), PoolingParams(T.CLASSIFY, normalize=True), "normalize"),
        (_matryoshka(None), PoolingParams(T.EMBED, use_activation=True), "use_activation"),
        (_seq_classifier(1), PoolingParams(T.REWARD, step_tag_id=5), "step_tag_id"),
        (_seq_classifier(1), PoolingParams(T.REWARD, use_activation=False), "use_activation"),
        (_prm(), PoolingParams(T.REWARD, returned_token_ids=(2,)), "returned_token_ids"),
        (_prm(), PoolingParams(T.REWARD, returned_token_ids=(-1,)), "returned_token_ids"),
        (_prm(), PoolingParams(T.REWARD, returned_token_ids=()), "returned_token_ids"),
        (_prm(), PoolingParams(T.REWARD, step_tag_id=-1), "step_tag_id"),
    ],
)
def test_invalid_params_name_the_field(
    info: PoolingModelInfo, params: PoolingParams, field: str
) -> None:
    with pytest.raises(InvalidPoolingParamsError) as caught:
        build_pooler(info, params, async_scheduling=True, stats=CloneStats())
    assert caught.value.param_name == field
    assert str(caught.value).startswith(f"{field}: ")


@pytest.mark.parametrize(
    ("info", "params"),
    [
        (_matryoshka(None), PoolingParams(T.EMBED, dimensions=HIDDEN)),
        (_matryoshka((16, 32)), PoolingParams(T.EMBED, dimensions=16, normalize=False)),
        (_prm(), PoolingParams(T.REWARD, step_tag_id=3, returned_token_ids=(1,))),
        (_seq_classifier(3), PoolingParams(T.CLASSIFY, use_activation=False)),
        (_decoder_token_classifier(), PoolingParams(T.EMBED_TOKEN_CLASSIFY, normalize=False)),
    ],
)
def test_valid_params_pass(info: PoolingModelInfo, params: PoolingParams) -> None:
    validate_params(info, params)


def test_matryoshka_list_is_enforced_and_applied() -> None:
    stats = CloneStats()
    params = PoolingParams(T.EMBED, dimensions=16, normalize=False)
    pooler = build_pooler(_matryoshka((16, 32)), params, async_scheduling=False, stats=stats)
    hidden = torch.randn(5, HIDDEN)
    out = pooler.add_chunk(hidden, [1, 2, 3, 4, 5], is_last=True)
    assert out is not None and torch.equal(out, hidden[-1, :16])


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"is_decoder": True}, PoolingType.LAST),
        ({"is_decoder": False}, PoolingType.CLS),
        ({"is_decoder": True, "st_pooling_mode": "lasttoken"}, PoolingType.LAST),
        ({"is_decoder": True, "st_pooling_mode": "mean"}, PoolingType.MEAN),
        ({"is_decoder": False, "st_pooling_mode": "cls"}, PoolingType.CLS),
        ({"is_decoder": False, "st_pooling_mode": "mean"}, PoolingType.MEAN),
        (
            {
                "is_decoder": True,
                "st_pooling_mode": "mean",
                "default_pooling_type": PoolingType.CLS,
            },
            PoolingType.CLS,
        ),
    ],
)
def test_default_embed_method(kwargs: dict[str, object], expected: PoolingType) -> None:
    info = PoolingModelInfo(hidden_size=HIDDEN, **kwargs)  # type: ignore[arg-type]
    pooler = build_pooler(info, PoolingParams(T.EMBED), async_scheduling=False, stats=CloneStats())
    assert pooler.pooling_type is expected


def test_task_methods() -> None:
    def method(info: PoolingModelInfo, task: PoolingTask) -> PoolingType:
        params = PoolingParams(task)
        return build_pooler(info, params, async_scheduling=False, stats=CloneStats()).pooling_type

    assert method(_seq_classifier(3), T.CLASSIFY) is PoolingType.LAST
    assert method(_seq_classifier(1), T.REWARD) is PoolingType.LAST
    assert method(_prm(), T.REWARD) is PoolingType.STEP
    assert method(_decoder_base(), T.TOKEN_EMBED) is PoolingType.ALL
    assert method(_decoder_token_classifier(), T.EMBED_TOKEN_CLASSIFY) is PoolingType.ALL


def test_default_step_tag_comes_from_the_model() -> None:
    head = nn.Sequential(nn.Linear(HIDDEN, 2))
    info = PoolingModelInfo(
        is_decoder=True,
        hidden_size=HIDDEN,
        process_reward_head=head,
        num_labels=2,
        default_step_tag_id=9,
    )
    pooler = build_pooler(info, PoolingParams(T.REWARD), async_scheduling=False, stats=CloneStats())
    out = pooler.add_chunk(torch.randn(6, HIDDEN), [1, 9, 2, 9, 9, 3], is_last=True)
    assert out is not None and out.shape == (3, 2)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"st_pooling_mode": "max"},
        {"hidden_size": 0},
        {"seq_classifier": nn.Linear(HIDDEN, 2)},  # no num_labels
        {
            "seq_classifier": nn.Linear(HIDDEN, 2),
            "token_classifier": nn.Linear(HIDDEN, 2),
            "num_labels": 2,
        },
    ],
)
def test_inconsistent_model_info_is_refused(kwargs: dict[str, object]) -> None:
    fields: dict[str, object] = {"is_decoder": True, "hidden_size": HIDDEN, **kwargs}
    with pytest.raises(PoolingConfigError):
        PoolingModelInfo(**fields)  # type: ignore[arg-type]
