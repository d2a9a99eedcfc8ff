"""Images through the real app on tiny CLIP, SigLIP and SigLIP 2 (naflex) checkpoints: every
route shape that takes an image (vLLM's messages with image_url parts, Cohere's images and
inputs, Infinity's modality image) equals transformers' get_image_features, texts equal
get_text_features, and requests of both kinds sent at once (batched into the same steps) equal
them too; SigLIP 2's images of every aspect, each its own grid of patches, in one request and
across concurrent ones; what a model cannot do with an image is a 400 before any work."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests.tiny_images import FAMILIES, Reference, data_url, images, save_dual_encoder

TOLERANCE = 1e-4  # relative to the reference's scale (DESIGN.md's float32 bound)
PICTURES = images(6)
TEXTS = ["w1 w2 w3", "w5 w7 w9 w11 w13 w2", "w40"]


def _unit(rows: np.ndarray) -> np.ndarray:
    return rows / np.linalg.norm(rows, axis=-1, keepdims=True)


def _close(got: Any, want: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == want.shape
    scale = float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= TOLERANCE * scale


@pytest.fixture(scope="module", params=FAMILIES)
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Any, Reference]]:
    from starlette.testclient import TestClient

    from poolserve.config.settings import ServerSettings
    from poolserve.http.app import create_app

    family = request.param
    directory = save_dual_encoder(family, tmp_path_factory.mktemp(family))
    settings = ServerSettings(model=str(directory), served_model_name=family, max_num_seqs=4)
    with TestClient(create_app(settings)) as client:
        yield client, Reference(Path(directory), family)


def _image_message(url: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]


def test_vllm_messages_image_equals_get_image_features(served: tuple[Any, Reference]) -> None:
    client, reference = served
    want = reference.images(PICTURES[:3])
    for index, picture in enumerate(PICTURES[:3]):
        for normalize, expected in ((False, want[index]), (None, _unit(want)[index])):
            body: dict[str, Any] = {"messages": _image_message(data_url(picture))}
            if normalize is not None:
                body["normalize"] = normalize
            response = client.post("/v1/embeddings", json=body)
            assert response.status_code == 200, response.text
            _close(response.json()["data"][0]["embedding"], expected)


def test_batch_of_conversations_and_pooling_route(served: tuple[Any, Reference]) -> None:
    client, reference = served
    conversations = [
        _image_message(data_url(p.convert("RGB"), "JPEG" if i % 2 else "WEBP"))
        for i, p in enumerate(PICTURES[:2])
    ]
    conversations.append([{"role": "user", "content": [{"type": "text", "text": TEXTS[0]}]}])
    response = client.post("/v1/embeddings", json={"messages": conversations, "normalize": False})
    assert response.status_code == 200, response.text
    rows = [item["embedding"] for item in response.json()["data"]]
    _close(rows[2], reference.texts(TEXTS[:1])[0])
    # JPEG is lossy: the reference decodes the same bytes
    decoded = [_decoded(c[0]["content"][0]["image_url"]["url"]) for c in conversations[:2]]
    _close(rows[:2], reference.images(decoded))
    pooled = client.post(
        "/v1/pooling",
        json={"messages": _image_message(data_url(PICTURES[3])), "task": "embed"},
    )
    assert pooled.status_code == 200, pooled.text
    _close(pooled.json()["data"][0]["data"], _unit(reference.images(PICTURES[3:4]))[0])


def test_texts_equal_get_text_features(served: tuple[Any, Reference]) -> None:
    client, reference = served
    response = client.post("/v1/embeddings", json={"input": TEXTS, "normalize": False})
    assert response.status_code == 200, response.text
    _close([item["embedding"] for item in response.json()["data"]], reference.texts(TEXTS))


def test_cohere_images_and_inputs(served: tuple[Any, Reference]) -> None:
    client, reference = served
    urls = [data_url(p) for p in PICTURES[:2]]
    response = client.post(
        "/v2/embed", json={"images": urls, "input_type": "image", "embedding_types": ["float"]}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert "texts" not in body
    _close(body["embeddings"]["float"], _unit(reference.images(PICTURES[:2])))
    inputs = [
        {"content": [{"type": "image_url", "image_url": {"url": urls[1]}}]},
        {"content": [{"type": "text", "text": TEXTS[1]}]},
    ]
    response = client.post("/v2/embed", json={"inputs": inputs, "embedding_types": ["float"]})
    assert response.status_code == 200, response.text
    floats = response.json()["embeddings"]["float"]
    _close(floats[0], _unit(reference.images(PICTURES[1:2]))[0])
    _close(floats[1], _unit(reference.texts(TEXTS[1:2]))[0])


def test_infinity_modality_image(served: tuple[Any, Reference]) -> None:
    client, reference = served
    urls = [data_url(p) for p in PICTURES[2:5]]
    response = client.post("/embeddings", json={"input": urls, "modality": "image"})
    assert response.status_code == 200, response.text
    rows = [item["embedding"] for item in response.json()["data"]]
    # Infinity answers normalized embeddings
    _close(rows, _unit(reference.images(PICTURES[2:5])))


def test_images_and_texts_at_once_equal_the_reference(served: tuple[Any, Reference]) -> None:
    """Many requests of both kinds in flight: steps batch images with texts; each answer is
    still its own input's embedding."""
    client, reference = served
    want_images, want_texts = reference.images(PICTURES), reference.texts(TEXTS)
    work = [("image", i) for i in range(len(PICTURES))] + [("text", i) for i in range(len(TEXTS))]

    def call(item: tuple[str, int]) -> np.ndarray:
        kind, index = item
        body: dict[str, Any] = (
            {"messages": _image_message(data_url(PICTURES[index]))}
            if kind == "image"
            else {"input": TEXTS[index]}
        )
        response = client.post("/v1/embeddings", json={**body, "normalize": False})
        assert response.status_code == 200, response.text
        return np.asarray(response.json()["data"][0]["embedding"], dtype=np.float32)

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(call, work * 2))
    for (kind, index), row in zip(work * 2, got, strict=True):
        _close(row, (want_images if kind == "image" else want_texts)[index])


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        (  # an image and a text in one conversation: a dual encoder embeds one or the other
            "/v1/embeddings",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "w1"},
                            {"type": "image_url", "image_url": {"url": "IMAGE"}},
                        ],
                    }
                ]
            },
            "messages",
        ),
        (  # an image gives one vector: no per-token output
            "/v1/pooling",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "IMAGE"}}],
                    }
                ],
                "task": "token_embed",
            },
            "task",
        ),
        (
            "/v1/embeddings",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}
                        ],
                    }
                ]
            },
            None,
        ),
        ("/v2/embed", {"images": ["IMAGE"], "texts": ["w1"]}, "images"),
        ("/embeddings", {"input": ["w1"], "modality": "audio"}, "modality"),
    ],
)
def test_refusals_are_400(
    served: tuple[Any, Reference], route: str, body: dict[str, Any], field: str | None
) -> None:
    client, _ = served
    response = client.post(route, json=_swap(body))
    assert response.status_code == 400, response.text
    if field is not None:
        assert field in response.text


def _decoded(url: str) -> Image.Image:
    """The image a data URL holds."""
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))


def _swap(value: Any) -> Any:
    """The body with "IMAGE" replaced by a real image's data URL."""
    if value == "IMAGE":
        return data_url(PICTURES[0])
    if isinstance(value, dict):
        return {k: _swap(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_swap(v) for v in value]
    return value


def _cosines(query: np.ndarray, documents: np.ndarray) -> np.ndarray:
    return _unit(documents) @ _unit(query[None])[0]


def test_rerank_and_score_of_multimodal_documents(served: tuple[Any, Reference]) -> None:
    """vLLM's multimodal documents (each content part one document): a text query against
    images and a text, scored by the cosine of the two towers' embeddings."""
    client, reference = served
    urls = [data_url(p) for p in PICTURES[:3]]
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    parts.append({"type": "text", "text": TEXTS[2]})
    query = reference.texts(TEXTS[:1])[0]
    documents = np.concatenate([reference.images(PICTURES[:3]), reference.texts(TEXTS[2:3])])
    want = _cosines(query, documents)
    response = client.post("/v1/rerank", json={"query": TEXTS[0], "documents": {"content": parts}})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [r["index"] for r in results] == list(np.argsort(-want, kind="stable"))
    for result in results:
        assert abs(result["relevance_score"] - want[result["index"]]) <= TOLERANCE
        expected = parts[result["index"]]
        document = result["document"]
        assert document == (
            {"text": expected["text"]} if expected["type"] == "text" else {"multi_modal": expected}
        )
    scored = client.post("/score", json={"text_1": TEXTS[0], "text_2": {"content": parts}})
    assert scored.status_code == 200, scored.text
    got = [item["score"] for item in scored.json()["data"]]
    assert np.abs(np.asarray(got) - want).max() <= TOLERANCE


def test_text_pairs_score_as_the_text_tower_embeds(served: tuple[Any, Reference]) -> None:
    client, reference = served
    response = client.post("/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]})
    assert response.status_code == 200, response.text
    embedded = reference.texts(TEXTS)
    want = _cosines(embedded[0], embedded[1:])
    got = [item["score"] for item in response.json()["data"]]
    assert np.abs(np.asarray(got) - want).max() <= TOLERANCE


def test_jina_input_objects(served: tuple[Any, Reference]) -> None:
    """Jina's `input: [{"text"}, {"image"}]` (jina-clip clients): one embedding each, in order;
    objects of texts alone are texts."""
    client, reference = served
    body = {"input": [{"text": TEXTS[1]}, {"image": data_url(PICTURES[4])}], "normalize": False}
    response = client.post("/v1/embeddings", json=body)
    assert response.status_code == 200, response.text
    rows = [item["embedding"] for item in response.json()["data"]]
    _close(rows[0], reference.texts(TEXTS[1:2])[0])
    _close(rows[1], reference.images(PICTURES[4:5])[0])
    texts = client.post("/v1/embeddings", json={"input": [{"text": t} for t in TEXTS]})
    assert texts.status_code == 200, texts.text
    _close([item["embedding"] for item in texts.json()["data"]], _unit(reference.texts(TEXTS)))
    both = client.post("/v1/embeddings", json={"input": [{"text": "w1", "image": "x"}]})
    assert both.status_code == 400, both.text


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    """A local HTTP server of one PNG (`/picture.png`): the base URL."""
    import http.server
    import threading

    png = base64.b64decode(data_url(PICTURES[5]).split(",", 1)[1])

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_real_server_fetches_an_allowed_url(
    image_host: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`poolserve serve` (supervisor, engine core, front end: the pixels cross the socket) with
    the host allowed: a URL's image equals transformers' embedding of it; the in-process app
    without the flags refuses the same URL before fetching it."""
    from tests.http.serving import live_server

    directory = save_dual_encoder("clip", tmp_path_factory.mktemp("live-clip"))
    reference = Reference(Path(directory), "clip")
    body = {"messages": _image_message(f"{image_host}/picture.png"), "normalize": False}
    flags = ("--allowed-media-domains", "127.0.0.1", "--allow-private-media-addresses")
    with live_server(str(directory), *flags) as client:
        response = client.post("/v1/embeddings", json=body)
        assert response.status_code == 200, response.text
        _close(response.json()["data"][0]["embedding"], reference.images(PICTURES[5:6])[0])
        # an image counts its tower's tokens: (32 / 8) ** 2 patches and CLIP's CLS token
        assert response.json()["usage"]["prompt_tokens"] == 17


def test_a_url_is_refused_unless_allowed(served: tuple[Any, Reference], image_host: str) -> None:
    client, _ = served
    body = {"messages": _image_message(f"{image_host}/picture.png")}
    response = client.post("/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "image_url_not_allowed"


def test_the_card_declares_images(served: tuple[Any, Reference]) -> None:
    client, _ = served
    assert client.get("/info").json()["modalities"] == ["text", "image"]
    models = client.get("/models").json()["data"]
    assert "image_embed" in models[0]["capabilities"]


def test_images_per_request_are_bounded_before_any_is_loaded(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from starlette.testclient import TestClient

    from poolserve.config.settings import ServerSettings
    from poolserve.http.app import create_app

    directory = save_dual_encoder("clip", tmp_path_factory.mktemp("capped"))
    settings = ServerSettings(model=str(directory), max_images_per_request=2)
    url = data_url(PICTURES[0])
    with TestClient(create_app(settings)) as client:
        ok = client.post("/v2/embed", json={"images": [url, url], "embedding_types": ["float"]})
        assert ok.status_code == 200, ok.text
        # the third is never decoded: an invalid one there would otherwise be a different 400
        refused = client.post("/v2/embed", json={"images": [url, url, "@@"]})
        assert refused.status_code == 400, refused.text
        assert "--max-images-per-request" in refused.json()["error"]["message"]


def test_a_half_precision_on_the_cpu_is_refused(tmp_path: Path) -> None:
    """Its towers' kernels are not measured at start: never silently slower than float32."""
    import torch

    from poolserve.models.loader import load_model
    from poolserve.types.errors import UnsupportedDtypeError

    directory = save_dual_encoder("clip", tmp_path / "clip")
    with pytest.raises(UnsupportedDtypeError, match="runs float32 on the CPU"):
        load_model(str(directory), device=torch.device("cpu"), dtype=torch.bfloat16)


def test_cpu_steps_get_threads_by_the_towers_work(tmp_path: Path) -> None:
    """The engine sizes a CPU step's threads by its matmul FLOPs per token: a dual encoder's
    projections must count (they once did not, and every CLIP step ran on one thread)."""
    import torch

    from poolserve.engine.cpu_threads import matmul_flops_per_token
    from poolserve.models.loader import load_model

    loaded = load_model(
        str(save_dual_encoder("clip", tmp_path / "clip")), device=torch.device("cpu")
    )
    reference = Reference(tmp_path / "clip", "clip").model.text_model.encoder.layers
    matrices = [p for p in reference.parameters() if p.dim() == 2]
    assert matmul_flops_per_token(loaded.model) == 2 * sum(p.numel() for p in matrices)


def test_the_cohere_sdk_embeds_images(served: tuple[Any, Reference]) -> None:
    """Cohere's own client (ClientV2.embed with images and input_type image), unchanged."""
    import cohere

    client, reference = served
    co = cohere.ClientV2(base_url=str(client.base_url), api_key="k", httpx_client=client)
    answer = co.embed(
        model=reference.family,
        input_type="image",
        embedding_types=["float"],
        images=[data_url(PICTURES[2])],
    )
    assert answer.embeddings.float_ is not None
    _close(answer.embeddings.float_[0], _unit(reference.images(PICTURES[2:3]))[0])


# ---- SigLIP 2 (naflex): each image its own grid of patches ---------------------------------------
# (height, width) in pixels: strips, a dot, squares; the tiny checkpoint's grids from 1x24 to 24x1
NAFLEX_SIZES = [(5, 300), (300, 7), (1, 1), (64, 64), (17, 200), (33, 31), (200, 17), (9, 90)]


@pytest.fixture(scope="module")
def naflex(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Reference]]:
    from starlette.testclient import TestClient

    from poolserve.config.settings import ServerSettings
    from poolserve.http.app import create_app

    directory = save_dual_encoder("siglip2", tmp_path_factory.mktemp("naflex"))
    settings = ServerSettings(model=str(directory), served_model_name="siglip2", max_num_seqs=32)
    with TestClient(create_app(settings)) as client:
        yield client, Reference(Path(directory), "siglip2")


def _naflex_pictures() -> list[Image.Image]:
    rng = np.random.default_rng(11)
    return [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in NAFLEX_SIZES
    ]


def test_naflex_images_of_every_aspect_and_texts_in_one_request(
    naflex: tuple[Any, Reference],
) -> None:
    client, reference = naflex
    pictures = _naflex_pictures()
    texts = ["A Photo Of W40", "w5 w7"]  # Siglip2Tokenizer lowercases the first
    inputs = [
        {"content": [{"type": "image_url", "image_url": {"url": data_url(p)}}]} for p in pictures
    ] + [{"content": [{"type": "text", "text": t}]} for t in texts]
    response = client.post("/v2/embed", json={"inputs": inputs, "embedding_types": ["float"]})
    assert response.status_code == 200, response.text
    floats = response.json()["embeddings"]["float"]
    _close(floats[: len(pictures)], _unit(reference.images(pictures)))
    _close(floats[len(pictures) :], _unit(reference.texts(texts)))
    conversations = [_image_message(data_url(p)) for p in pictures]
    response = client.post("/v1/embeddings", json={"messages": conversations, "normalize": False})
    assert response.status_code == 200, response.text
    _close([item["embedding"] for item in response.json()["data"]], reference.images(pictures))


def test_naflex_images_across_concurrent_requests(naflex: tuple[Any, Reference]) -> None:
    client, reference = naflex
    pictures = _naflex_pictures()
    want = reference.images(pictures)
    urls = [data_url(p) for p in pictures]

    def call(index: int) -> Any:
        body = {"input": [urls[index]], "modality": "image"}
        response = client.post("/embeddings", json=body)
        assert response.status_code == 200, response.text
        return response.json()["data"][0]["embedding"]

    work = list(range(len(pictures))) * 3
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(call, work))
    for index, row in zip(work, got, strict=True):
        _close(row, _unit(want[index : index + 1])[0])
