"""Late interaction (ColBERT): the saved projection, projected token embeddings, MaxSim scores."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer

from poolserve.models.heads import build_head
from poolserve.models.late_interaction import check_plain_prompts, colbert_projection
from poolserve.models.loader import load_model
from poolserve.models.registry import ArchitectureEntry, Backbone
from poolserve.models.weights import load_state_dict
from poolserve.pooling.pooler import ChunkInput, pool_step
from poolserve.pooling.stats import CloneStats
from poolserve.pooling.tasks import build_pooler
from poolserve.types.errors import ModelLoadError, UnsupportedTaskError
from poolserve.types.model_info import PoolingModelInfo, get_supported_tasks
from poolserve.types.params import PoolingParams
from poolserve.types.scoring import PairMode, maxsim_score, scorer_plan
from poolserve.types.tasks import HeadKind, PoolingTask
from tests.models.driver import run_whole
from tests.tiny_encoders import build_hf_encoder, save_tiny_encoder

COLBERT_DIM = 8
# The entry a ColBERT checkpoint is read with: a BERT backbone under `bert.`, the projection beside.
COLBERT_ENTRY = ArchitectureEntry(Backbone.ENCODER, HeadKind.LATE_INTERACTION, ("bert.", ""))
# The backbone alone loads as BERT; the ColBERT entry then reads the projection beside it.
AS_BERT = {"architectures": ["BertModel"]}
QUERY = "what is the capital of france"
DOCUMENTS = [
    "paris is the capital and largest city of france",
    "the cat sat on the mat",
    "berlin is the capital of germany, a country next to france",
]


@pytest.fixture(scope="module")
def colbert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BERT saved as Stanford ColBERT saves HF_ColBERT: `bert.*` plus `linear.weight`."""
    directory = save_tiny_encoder("bert", tmp_path_factory.mktemp("colbert"))
    weights = directory / "model.safetensors"
    state = {f"bert.{name}": tensor for name, tensor in load_file(weights).items()}
    hidden = state["bert.embeddings.word_embeddings.weight"].shape[1]
    generator = torch.Generator().manual_seed(3)
    state["linear.weight"] = torch.randn(COLBERT_DIM, hidden, generator=generator)
    save_file(state, weights)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(
        json.dumps({**config, "architectures": ["HF_ColBERT"], "dim": COLBERT_DIM})
    )
    return directory


def _projection(directory: Path) -> torch.nn.Module | None:
    state = load_state_dict(directory)
    return build_head(
        COLBERT_ENTRY, state, torch.device("cpu"), AutoConfig.from_pretrained(directory)
    )


def _info(projection: torch.nn.Module, hidden: int) -> PoolingModelInfo:
    return PoolingModelInfo(is_decoder=False, hidden_size=hidden, token_projection=projection)


def _token_embeddings(info: PoolingModelInfo, hidden: torch.Tensor) -> np.ndarray:
    params = PoolingParams(task=PoolingTask.TOKEN_EMBED)
    pooler = build_pooler(info, params, async_scheduling=False, stats=CloneStats())
    chunk = ChunkInput(hidden.shape[0], list(range(hidden.shape[0])), True)
    (output,) = pool_step(hidden, [chunk], [pooler])
    assert output is not None
    return output.numpy()


def _naive_maxsim(query: torch.Tensor, document: torch.Tensor) -> float:
    """Sum over query tokens of the best dot product with any document token, one at a time."""
    total = 0.0
    for q in query.double():
        total += max(float(q @ d) for d in document.double())
    return total


def test_projection_is_read_from_the_checkpoint(colbert_dir: Path) -> None:
    state = load_state_dict(colbert_dir)
    projection = _projection(colbert_dir)
    assert projection is not None
    torch.testing.assert_close(projection.weight, state["linear.weight"])


def test_maxsim_equals_a_naive_transformers_reference(colbert_dir: Path) -> None:
    loaded = load_model(str(colbert_dir), device=torch.device("cpu"), hf_overrides=AS_BERT)
    projection = _projection(colbert_dir)
    assert projection is not None
    info = _info(projection, loaded.spec.hidden_size)
    plan = scorer_plan(info)
    assert (plan.mode, plan.task, plan.compare) == (
        PairMode.SEPARATE,
        PoolingTask.TOKEN_EMBED,
        maxsim_score,
    )
    tokenizer = AutoTokenizer.from_pretrained(colbert_dir)
    texts = [QUERY, *DOCUMENTS]
    prompts = [list(tokenizer(t)["input_ids"]) for t in texts]
    ours = [_token_embeddings(info, h) for h in run_whole(loaded, prompts, torch.device("cpu"))]
    reference = build_hf_encoder("bert")  # the same seeded weights the fixture saved
    weight = load_state_dict(colbert_dir)["linear.weight"]
    with torch.no_grad():
        projected = [
            torch.nn.functional.normalize(
                reference(torch.tensor([p])).last_hidden_state[0] @ weight.T, dim=-1
            )
            for p in prompts
        ]
    for document in range(1, len(texts)):
        want = _naive_maxsim(projected[0], projected[document])
        got = plan.compare(ours[0], ours[document]) if plan.compare else None
        assert got == pytest.approx(want, abs=1e-4 * len(prompts[0]))
    assert ours[0].shape == (len(prompts[0]), COLBERT_DIM)


def test_late_interaction_serves_token_embed_only() -> None:
    info = _info(torch.nn.Linear(16, COLBERT_DIM, bias=False), 16)
    assert info.head_kind is HeadKind.LATE_INTERACTION
    assert get_supported_tasks(info) == {PoolingTask.TOKEN_EMBED}
    with pytest.raises(UnsupportedTaskError):
        build_pooler(
            info, PoolingParams(task=PoolingTask.EMBED), async_scheduling=False, stats=CloneStats()
        )


def test_maxsim_score_sums_the_best_match_of_each_query_token() -> None:
    query = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    document = np.array([[0.6, 0.8], [1.0, 0.0], [0.0, -1.0]], np.float32)
    assert maxsim_score(query, document) == pytest.approx(1.0 + 0.8)


def test_projection_layouts_and_refusals(colbert_dir: Path) -> None:
    loaded = load_model(str(colbert_dir), device=torch.device("cpu"), hf_overrides=AS_BERT)
    config = AutoConfig.from_pretrained(colbert_dir)
    weight = torch.ones(COLBERT_DIM, loaded.spec.hidden_size)
    renamed = colbert_projection({"colbert_linear.weight": weight}, config)
    torch.testing.assert_close(renamed.weight, weight)
    with pytest.raises(ModelLoadError, match="needs its projection"):
        colbert_projection({}, config)
    with pytest.raises(ModelLoadError, match="no bias"):
        colbert_projection({"linear.weight": weight, "linear.bias": weight[:, 0]}, config)
    with pytest.raises(ModelLoadError, match="states ColBERT dim"):
        colbert_projection({"linear.weight": torch.ones(4, loaded.spec.hidden_size)}, config)


def test_marker_and_augmentation_configs_are_refused(tmp_path: Path) -> None:
    check_plain_prompts(tmp_path)  # a plain checkpoint passes
    pylate = {"query_prefix": "[Q] "}
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(pylate))
    with pytest.raises(ModelLoadError, match="query_prefix"):
        check_plain_prompts(tmp_path)
    (tmp_path / "artifact.metadata").write_text(json.dumps({"query_maxlen": 32}))
    with pytest.raises(ModelLoadError, match=r"\[MASK\] query augmentation"):
        check_plain_prompts(tmp_path)


def test_colbert_checkpoint_served_through_score_and_rerank(colbert_dir: Path) -> None:
    from starlette.testclient import TestClient

    from poolserve.config.settings import ServerSettings
    from poolserve.http.app import create_app

    settings = ServerSettings(model=str(colbert_dir), served_model_name="colbert")
    with TestClient(create_app(settings)) as client:
        score = client.post("/score", json={"text_1": QUERY, "text_2": DOCUMENTS})
        rerank = client.post("/rerank", json={"query": QUERY, "documents": DOCUMENTS})
        embed = client.post("/v1/embeddings", json={"input": QUERY})
        ids = [client.post("/tokenize", json={"prompt": t}).json()["tokens"] for t in DOCUMENTS]
        query_ids = client.post("/tokenize", json={"prompt": QUERY}).json()["tokens"]
    assert score.status_code == 200, score.text
    assert rerank.status_code == 200, rerank.text
    assert embed.status_code == 400 and embed.json()["error"]["code"] == "unsupported_task"
    reference = build_hf_encoder("bert")
    projection = load_state_dict(colbert_dir)["linear.weight"]

    def tokens(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            hidden = reference(input_ids=torch.tensor([prompt])).last_hidden_state[0]
        return torch.nn.functional.normalize(hidden @ projection.T, dim=-1)

    query = tokens(query_ids)
    want = [_naive_maxsim(query, tokens(doc)) for doc in ids]
    got = [item["score"] for item in score.json()["data"]]
    assert np.allclose(got, want, atol=1e-4 * len(query_ids))
    ranked = [item["index"] for item in rerank.json()["results"]]
    assert ranked == sorted(range(len(want)), key=lambda i: -want[i])
