"""Scorers: the (head kind -> scorer) table, the cross-encoder head, cosine similarity."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from poolserve.pooling.pooler import ChunkInput, pool_step
from poolserve.pooling.stats import CloneStats
from poolserve.pooling.tasks import build_pooler
from poolserve.types.errors import InvalidPoolingParamsError, UnsupportedTaskError
from poolserve.types.model_info import PoolingModelInfo, ScoreActivation, get_supported_tasks
from poolserve.types.params import PoolingParams
from poolserve.types.scoring import PairMode, cosine_score, scorer_plan
from poolserve.types.tasks import PoolingTask, PoolingType

HIDDEN = 16
T = PoolingTask


def _classifier(num_labels: int, **extra: object) -> PoolingModelInfo:
    torch.manual_seed(0)
    head = nn.Linear(HIDDEN, num_labels)
    return PoolingModelInfo(
        is_decoder=False, hidden_size=HIDDEN, seq_classifier=head, num_labels=num_labels, **extra
    )


def _score(info: PoolingModelInfo, params: PoolingParams, hidden: torch.Tensor) -> torch.Tensor:
    pooler = build_pooler(info, params, async_scheduling=False, stats=CloneStats())
    chunk = ChunkInput(hidden.shape[0], list(range(hidden.shape[0])), True)
    (output,) = pool_step(hidden, [chunk], [pooler])
    assert output is not None
    return output


def test_one_label_classifiers_score_joint_prompts() -> None:
    info = _classifier(1)
    assert get_supported_tasks(info) == {T.CLASSIFY, T.REWARD, T.SCORE}
    plan = scorer_plan(info)
    assert (plan.mode, plan.task) == (PairMode.JOINT, T.SCORE)


def test_embedding_models_score_by_cosine_of_two_embeddings() -> None:
    plan = scorer_plan(PoolingModelInfo(is_decoder=True, hidden_size=HIDDEN))
    assert (plan.mode, plan.task) == (PairMode.SEPARATE, T.EMBED)


@pytest.mark.parametrize(
    ("info", "served"),
    [
        (_classifier(3), "classify"),
        (
            PoolingModelInfo(
                is_decoder=True,
                hidden_size=HIDDEN,
                token_classifier=nn.Linear(HIDDEN, 4),
                num_labels=4,
            ),
            "embed&token_classify, token_classify",
        ),
    ],
)
def test_a_model_without_a_scorer_names_what_it_serves(info: PoolingModelInfo, served: str) -> None:
    with pytest.raises(UnsupportedTaskError) as caught:
        scorer_plan(info)
    assert caught.value.task == "score"
    assert str(caught.value).endswith(f"supported tasks: {served}")


@pytest.mark.parametrize(
    ("activation", "expected"),
    [
        (ScoreActivation.SIGMOID, torch.sigmoid),
        (ScoreActivation.IDENTITY, lambda x: x),
        (ScoreActivation.TANH, torch.tanh),
    ],
)
def test_score_head_applies_the_saved_activation_or_none(
    activation: ScoreActivation, expected: object
) -> None:
    info = _classifier(1, score_activation=activation)
    hidden = torch.randn(5, HIDDEN)  # CLS pooling: the first row is the pair's state
    assert info.seq_classifier is not None
    with torch.no_grad():
        logit = info.seq_classifier(hidden[0])  # [1]
    got = _score(info, PoolingParams(T.SCORE), hidden)
    torch.testing.assert_close(got, expected(logit))  # type: ignore[operator]
    raw = _score(info, PoolingParams(T.SCORE, use_activation=False), hidden)
    torch.testing.assert_close(raw, logit)


def test_score_pools_like_the_classifier() -> None:
    decoder = PoolingModelInfo(
        is_decoder=True, hidden_size=HIDDEN, seq_classifier=nn.Linear(HIDDEN, 1), num_labels=1
    )
    assert decoder.sequence_pooling_type is PoolingType.LAST
    hidden = torch.randn(4, HIDDEN)
    assert decoder.seq_classifier is not None
    with torch.no_grad():
        want = torch.sigmoid(decoder.seq_classifier(hidden[-1]))
    torch.testing.assert_close(_score(decoder, PoolingParams(T.SCORE), hidden), want)


def test_score_refuses_parameters_of_other_tasks() -> None:
    with pytest.raises(InvalidPoolingParamsError) as caught:
        _score(_classifier(1), PoolingParams(T.SCORE, normalize=True), torch.randn(2, HIDDEN))
    assert caught.value.param_name == "normalize"


def test_cosine_score_equals_torch() -> None:
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(32, generator=gen), torch.randn(32, generator=gen)
    want = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    assert cosine_score(a.numpy(), b.numpy()) == pytest.approx(want, abs=1e-6)
    assert cosine_score(a.numpy(), (3 * a).numpy()) == pytest.approx(1.0)
    assert cosine_score(np.zeros(4, np.float32), np.ones(4, np.float32)) == 0.0
