"""On a CUDA device: pooling never waits on the device, and bf16 hidden states pool in float32."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from poolserve.pooling import (
    ChunkInput,
    CloneStats,
    PoolingModelInfo,
    PoolingParams,
    PoolingTask,
    build_pooler,
    pool_step,
)

pytestmark = pytest.mark.gpu

HIDDEN = 64
STEP_TAG = 5


@pytest.fixture
def no_sync() -> Iterator[None]:
    """Make any synchronizing CUDA call raise while the test body runs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _prm_info() -> PoolingModelInfo:
    head = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 2)).cuda()
    return PoolingModelInfo(
        is_decoder=True, hidden_size=HIDDEN, process_reward_head=head, num_labels=2
    )


def test_chunked_step_pooling_never_syncs(no_sync: None) -> None:
    info = _prm_info()
    params = PoolingParams(PoolingTask.REWARD, step_tag_id=STEP_TAG, returned_token_ids=(1,))
    stats = CloneStats()
    poolers = [build_pooler(info, params, async_scheduling=True, stats=stats) for _ in range(2)]
    ids = [[1, STEP_TAG, 2, STEP_TAG], [STEP_TAG, 3, 4]]
    hidden = torch.randn(7, HIDDEN, device="cuda", dtype=torch.bfloat16)  # [7, hidden]
    chunks = [ChunkInput(4, ids[0], is_last=False), ChunkInput(3, ids[1], is_last=True)]
    first = pool_step(hidden, chunks, poolers)
    last = pool_step(hidden[:4], [ChunkInput(4, ids[0], is_last=True)], poolers[:1])
    outputs = [last[0], first[1]]
    assert first[0] is None
    for out, num_steps in zip(outputs, (4, 1), strict=True):
        assert out is not None
        assert out.device.type == "cuda" and out.dtype == torch.float32
        assert out.shape == (num_steps, 1)


def test_bf16_hidden_states_pool_in_float32(no_sync: None) -> None:
    info = PoolingModelInfo(is_decoder=True, hidden_size=HIDDEN)
    stats = CloneStats()
    hidden = torch.randn(9, HIDDEN, device="cuda", dtype=torch.bfloat16)  # [9, hidden]
    tasks = [PoolingTask.EMBED, PoolingTask.TOKEN_EMBED]
    poolers = [
        build_pooler(info, PoolingParams(t), async_scheduling=True, stats=stats) for t in tasks
    ]
    chunks = [ChunkInput(4, [1] * 4, is_last=True), ChunkInput(5, [1] * 5, is_last=True)]
    embed, token_embed = pool_step(hidden, chunks, poolers)
    assert embed is not None and embed.dtype == torch.float32 and embed.shape == (HIDDEN,)
    assert token_embed is not None and token_embed.shape == (5, HIDDEN)
    torch.cuda.set_sync_debug_mode("default")
    expected = torch.nn.functional.normalize(hidden[3].float(), dim=-1)
    torch.testing.assert_close(embed, expected, rtol=0, atol=1e-6)


def test_sparse_pooling_on_cuda_equals_the_cpu() -> None:
    # SPLADE's nonzero waits on the device once per finished request: no no_sync fixture here
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    vocab = 3000  # several row blocks: BLOCK_ELEMENTS // vocab rows at a time
    mlm = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.LayerNorm(HIDDEN))
    head = nn.Sequential(*mlm, nn.Linear(HIDDEN, vocab)).eval()
    hidden = torch.randn(2000, HIDDEN).bfloat16()  # [T, hidden], the bf16 states a forward writes
    ids = torch.randint(0, 50, (2000,)).tolist()
    outputs = []
    for device in ("cpu", "cuda"):
        info = PoolingModelInfo(
            is_decoder=False,
            hidden_size=HIDDEN,
            mlm_head=head.to(device),
            sparse_excluded_ids=frozenset({0, 1}),
        )
        params = PoolingParams(PoolingTask.EMBED_SPARSE)
        pooler = build_pooler(info, params, async_scheduling=True, stats=CloneStats())
        out = pooler.add_chunk(hidden.to(device), ids, is_last=True)
        assert out is not None and out.dtype == torch.float32 and out.device.type == device
        outputs.append(out.cpu())
    cpu, cuda = outputs
    assert torch.equal(cpu[0], cuda[0])  # the same non-zero ids
    torch.testing.assert_close(cuda[1], cpu[1], rtol=1e-4, atol=1e-5)
