"""End to end against Hugging Face: pooled outputs equal what transformers computes."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from poolserve.pooling import CloneStats, PoolingModelInfo, PoolingParams, PoolingTask, build_pooler
from tests.pooling.util import CHUNK_SIZES, SimRequest, assert_close, feed_chunked, run_steps
from tests.tiny_models import build_hf_model, reference_remote_head, remote_head_state

T = PoolingTask
NUM_TOKENS = 80  # long enough that chunk size 64 splits the prompt
STEP_TAG = 4242


@cache
def _hf(name: str) -> Any:
    """The transformers reference model, built once per session."""
    return build_hf_model(name)


@cache
def _prompt(num_tokens: int = NUM_TOKENS, seed: int = 0) -> tuple[int, ...]:
    # Ids avoid the pad id 0, so HF sequence classifiers pool the true last token.
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 30000, (num_tokens,), generator=gen)
    tags = [i for i in (5, 17, 40, 41, num_tokens - 1) if i < num_tokens]
    ids[tags] = STEP_TAG
    return tuple(ids.tolist())


def _ids_tensor(ids: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([ids])  # [1, num_tokens]


@cache
@torch.no_grad()
def _backbone_hidden(name: str, ids: tuple[int, ...]) -> torch.Tensor:
    """Last hidden states `[num_tokens, hidden]` of the reference model's backbone."""
    hf = _hf(name)
    backbone = getattr(hf, "model", hf)
    return backbone(input_ids=_ids_tensor(ids)).last_hidden_state[0]


@cache
@torch.no_grad()
def _hf_logits(name: str, ids: tuple[int, ...]) -> torch.Tensor:
    return _hf(name)(input_ids=_ids_tensor(ids)).logits[0]


def _pool(
    info: PoolingModelInfo,
    params: PoolingParams,
    hidden: torch.Tensor,
    ids: tuple[int, ...],
    chunk_size: int | None = None,
) -> torch.Tensor:
    stats = CloneStats()
    pooler = build_pooler(info, params, async_scheduling=True, stats=stats)
    out = feed_chunked(pooler, hidden, ids, chunk_size, async_scheduling=True)
    assert stats.num_open_poolers == 0
    return out


def _remote_head(name: str) -> nn.Module:
    """The PRM/RM head as a module, loaded from the checkpoint's `score.*` weights."""
    state = remote_head_state(name, 64)
    out = state["score.2.weight"].shape[0]
    head = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, out))
    head.load_state_dict({k.removeprefix("score."): v for k, v in state.items()})
    return head


def _classifier_fields(hf: Any) -> dict[str, Any]:
    num_labels = hf.config.num_labels
    labels = tuple(hf.config.id2label[i] for i in range(num_labels))
    return {"seq_classifier": hf.score, "num_labels": num_labels, "labels": labels}


# Head fields of each tiny model, built from the reference model (or checkpoint head weights).
HEAD_FIELDS: dict[str, Any] = {
    "llama_cls1": _classifier_fields,
    "llama_cls3": _classifier_fields,
    "qwen2_tokcls": lambda hf: {"token_classifier": hf.score, "num_labels": hf.config.num_labels},
    "qwen2_prm": lambda hf: {"process_reward_head": _remote_head("qwen2_prm"), "num_labels": 2},
    "qwen2_rm": lambda hf: {"token_reward_head": _remote_head("qwen2_rm"), "num_labels": 1},
}


def _info(name: str) -> PoolingModelInfo:
    """Pooling's view of a tiny model, built from the reference model's own head modules."""
    hf = _hf(name)
    fields = HEAD_FIELDS[name](hf) if name in HEAD_FIELDS else {}
    return PoolingModelInfo(is_decoder=name != "bert", hidden_size=hf.config.hidden_size, **fields)


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize(
    ("name", "st_mode", "reduce"),
    [
        ("llama", None, lambda h: h[-1]),
        ("mistral", None, lambda h: h[-1]),
        ("qwen3_base", "lasttoken", lambda h: h[-1]),
        ("qwen2", "mean", lambda h: h.mean(dim=0)),
        ("bert", None, lambda h: h[0]),
        ("bert", "mean", lambda h: h.mean(dim=0)),
    ],
)
def test_embed_matches_hf(name: str, st_mode: str | None, reduce: Any, chunk_size: int) -> None:
    ids = _prompt()
    hidden = _backbone_hidden(name, ids)
    info = PoolingModelInfo(
        is_decoder=name != "bert", hidden_size=hidden.shape[1], st_pooling_mode=st_mode
    )
    out = _pool(info, PoolingParams(T.EMBED), hidden, ids, chunk_size)
    assert_close(out, F.normalize(reduce(hidden), dim=-1))
    raw = _pool(info, PoolingParams(T.EMBED, normalize=False), hidden, ids, chunk_size)
    assert_close(raw, reduce(hidden))


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_token_embed_matches_hf(chunk_size: int | None) -> None:
    ids = _prompt()
    hidden = _backbone_hidden("qwen3", ids)
    info = _info("qwen3")
    out = _pool(info, PoolingParams(T.TOKEN_EMBED), hidden, ids, chunk_size)
    assert_close(out, F.normalize(hidden, dim=-1))
    raw = _pool(info, PoolingParams(T.TOKEN_EMBED, normalize=False), hidden, ids, chunk_size)
    assert_close(raw, hidden)


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_classify_matches_hf(chunk_size: int | None) -> None:
    ids = _prompt()
    for name, activation in (("llama_cls3", torch.softmax), ("llama_cls1", torch.sigmoid)):
        logits = _hf_logits(name, ids)  # [num_labels], HF pools the last token itself
        hidden = _backbone_hidden(name, ids)
        info = _info(name)
        out = _pool(info, PoolingParams(T.CLASSIFY), hidden, ids, chunk_size)
        expected = logits.softmax(-1) if activation is torch.softmax else logits.sigmoid()
        assert_close(out, expected)
        raw = PoolingParams(T.CLASSIFY, use_activation=False)
        assert_close(_pool(info, raw, hidden, ids, chunk_size), logits)
    assert _info("llama_cls3").labels == ("negative", "neutral", "positive")


def test_sequence_reward_is_raw_score() -> None:
    ids = _prompt()
    hidden = _backbone_hidden("llama_cls1", ids)
    out = _pool(_info("llama_cls1"), PoolingParams(T.REWARD), hidden, ids, 7)
    assert_close(out, _hf_logits("llama_cls1", ids))  # shape [1]


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_token_classify_matches_hf(chunk_size: int | None) -> None:
    ids = _prompt()
    logits = _hf_logits("qwen2_tokcls", ids)  # [num_tokens, num_labels]
    hidden = _backbone_hidden("qwen2_tokcls", ids)
    info = _info("qwen2_tokcls")
    out = _pool(info, PoolingParams(T.TOKEN_CLASSIFY), hidden, ids, chunk_size)
    assert_close(out, logits.softmax(-1))
    raw = PoolingParams(T.TOKEN_CLASSIFY, use_activation=False)
    assert_close(_pool(info, raw, hidden, ids, chunk_size), logits)
    both = _pool(info, PoolingParams(T.EMBED_TOKEN_CLASSIFY), hidden, ids, chunk_size)
    expected = torch.cat([F.normalize(hidden[-1], dim=-1), logits.softmax(-1).reshape(-1)])
    assert_close(both, expected)  # [hidden + num_tokens * num_labels]


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_process_reward_matches_reference_head(chunk_size: int | None) -> None:
    ids = _prompt()
    hidden = _backbone_hidden("qwen2_prm", ids)
    tags = [i for i, t in enumerate(ids) if t == STEP_TAG]
    expected = reference_remote_head("qwen2_prm")(hidden[tags]).softmax(-1)  # [num_steps, 2]
    info = _info("qwen2_prm")
    out = _pool(info, PoolingParams(T.REWARD, step_tag_id=STEP_TAG), hidden, ids, chunk_size)
    assert_close(out, expected)
    positive = PoolingParams(T.REWARD, step_tag_id=STEP_TAG, returned_token_ids=(1,))
    assert_close(_pool(info, positive, hidden, ids, chunk_size), expected[:, [1]])
    untagged = _pool(info, PoolingParams(T.REWARD), hidden, ids, chunk_size)
    assert_close(untagged, reference_remote_head("qwen2_prm")(hidden).softmax(-1))


def test_process_reward_without_tags_is_empty() -> None:
    ids = tuple(1000 + i for i in range(NUM_TOKENS))
    hidden = _backbone_hidden("qwen2_prm", ids)
    params = PoolingParams(T.REWARD, step_tag_id=STEP_TAG)
    for chunk_size in CHUNK_SIZES:
        assert _pool(_info("qwen2_prm"), params, hidden, ids, chunk_size).shape == (0, 2)


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_token_reward_matches_reference_head(chunk_size: int | None) -> None:
    ids = _prompt()
    hidden = _backbone_hidden("qwen2_rm", ids)
    expected = reference_remote_head("qwen2_rm")(hidden)[:, 0]  # [num_tokens]
    out = _pool(_info("qwen2_rm"), PoolingParams(T.REWARD), hidden, ids, chunk_size)
    assert_close(out, expected)


@torch.no_grad()
def _reference(name: str, ids: tuple[int, ...]) -> torch.Tensor:
    """What transformers (or the checkpoint's reward head) computes for the model's task."""
    if name == "qwen2_rm":
        return reference_remote_head(name)(_backbone_hidden(name, ids))[:, 0]
    return _hf_logits(name, ids).softmax(-1)


@pytest.mark.parametrize("token_budget", [7, 64])
def test_mixed_task_batches_match_hf(token_budget: int) -> None:
    cases = [
        ("llama_cls3", PoolingParams(T.CLASSIFY)),
        ("qwen2_tokcls", PoolingParams(T.TOKEN_CLASSIFY)),
        ("qwen2_rm", PoolingParams(T.REWARD)),
    ]
    stats = CloneStats()
    requests, expected = [], []
    for seed, (name, params) in enumerate(cases * 2):
        ids = _prompt(10 + 23 * seed, seed)
        pooler = build_pooler(_info(name), params, async_scheduling=True, stats=stats)
        requests.append(SimRequest(pooler, _backbone_hidden(name, ids), ids))
        expected.append(_reference(name, ids))
    outputs = run_steps(requests, token_budget, async_scheduling=True)
    for out, ref in zip(outputs, expected, strict=True):
        assert_close(out, ref)
    assert stats.num_open_poolers == 0
