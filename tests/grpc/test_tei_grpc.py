"""TEI's gRPC API (`--grpc-port`) on a real server process (tests/grpc/conftest.py), called
through a client compiled from the project's poolserve/grpc/tei.proto as a TEI user compiles
TEI's: each RPC and stream answers what the HTTP route answers for the same input; errors take
TEI's gRPC codes; a stream that is cancelled frees the engine, and one whose client does not read
stays bounded.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.grpc.serving import API_KEY, ROOT
from tests.http.test_server_process import free_port

pytestmark = pytest.mark.slow
AUTH = (("authorization", f"Bearer {API_KEY}"),)
RERANKER = (*AUTH, ("model", "reranker"))
SPLADE = (*AUTH, ("model", "splade"))
TEXTS = ["an embedding of a sentence", "another, somewhat longer sentence to embed", "short"]
QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "the cat sat on the mat", "berlin is in germany"]
PAGE = "x" * 2_000  # one 2 KB message
LONG = " ".join(["a long text keeps the engine busy for a while"] * 40)


def _post(http: httpx.Client, path: str, body: dict[str, Any]) -> Any:
    answer = http.post(path, json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _close(got: Any, want: Any) -> None:
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=1e-5)


def test_embed_rpcs_equal_tei_http(stubs: Any, channel: grpc.Channel, http: httpx.Client) -> None:
    pb, pb_grpc = stubs
    embed = pb_grpc.EmbedStub(channel)
    for text in TEXTS:
        for normalize in (True, False):
            got = embed.Embed(pb.EmbedRequest(inputs=text, normalize=normalize), metadata=AUTH)
            want = _post(http, "/embed", {"inputs": text, "normalize": normalize})[0]
            _close(got.embeddings, want)
            assert got.metadata.compute_tokens > 0 and got.metadata.compute_chars == len(text)
    cut = embed.Embed(pb.EmbedRequest(inputs=TEXTS[0], dimensions=8), metadata=AUTH)
    _close(cut.embeddings, _post(http, "/embed", {"inputs": TEXTS[0], "dimensions": 8})[0])
    unset = embed.Embed(pb.EmbedRequest(inputs=TEXTS[0]), metadata=AUTH)  # TEI: normalized
    assert abs(float(np.linalg.norm(unset.embeddings)) - 1.0) < 1e-5
    streamed = list(
        embed.EmbedStream(iter([pb.EmbedRequest(inputs=t) for t in TEXTS]), metadata=AUTH)
    )
    want_all = _post(http, "/embed", {"inputs": TEXTS})
    for got, want in zip(streamed, want_all, strict=True):
        _close(got.embeddings, want)
    every = embed.EmbedAll(pb.EmbedAllRequest(inputs=TEXTS[1]), metadata=AUTH)
    want_tokens = _post(http, "/embed_all", {"inputs": TEXTS[1]})[0]
    _close([list(t.embeddings) for t in every.token_embeddings], want_tokens)
    all_streamed = list(
        embed.EmbedAllStream(iter([pb.EmbedAllRequest(inputs=t) for t in TEXTS]), metadata=AUTH)
    )
    assert [len(a.token_embeddings) for a in all_streamed] == [
        len(rows) for rows in _post(http, "/embed_all", {"inputs": TEXTS})
    ]


def test_sparse_rpcs_equal_the_pooling_route(
    stubs: Any, channel: grpc.Channel, http: httpx.Client
) -> None:
    pb, pb_grpc = stubs
    embed = pb_grpc.EmbedStub(channel)
    body = {"model": "splade", "task": "embed_sparse", "input": TEXTS}
    want = [row["data"] for row in _post(http, "/v1/pooling", body)["data"]]
    got = embed.EmbedSparse(pb.EmbedSparseRequest(inputs=TEXTS[0]), metadata=SPLADE)
    assert [v.index for v in got.sparse_embeddings] == want[0]["indices"]
    _close([v.value for v in got.sparse_embeddings], want[0]["values"])
    messages = iter([pb.EmbedSparseRequest(inputs=t) for t in TEXTS])
    for answer, row in zip(embed.EmbedSparseStream(messages, metadata=SPLADE), want, strict=True):
        assert [v.index for v in answer.sparse_embeddings] == row["indices"]
        _close([v.value for v in answer.sparse_embeddings], row["values"])


def test_tokenize_and_decode_equal_tei_http(
    stubs: Any, channel: grpc.Channel, http: httpx.Client
) -> None:
    pb, pb_grpc = stubs
    tokenize = pb_grpc.TokenizeStub(channel)
    for special in (True, False):
        got = tokenize.Tokenize(
            pb.EncodeRequest(inputs="héllo world", add_special_tokens=special), metadata=AUTH
        )
        want = _post(http, "/tokenize", {"inputs": "héllo world", "add_special_tokens": special})
        tokens = [
            {
                "id": t.id,
                "text": t.text,
                "special": t.special,
                "start": t.start if t.HasField("start") else None,
                "stop": t.stop if t.HasField("stop") else None,
            }
            for t in got.tokens
        ]
        assert tokens == want[0]
    streamed = list(
        tokenize.TokenizeStream(
            iter([pb.EncodeRequest(inputs=t, add_special_tokens=True) for t in TEXTS]),
            metadata=AUTH,
        )
    )
    want_ids = [[t["id"] for t in row] for row in _post(http, "/tokenize", {"inputs": TEXTS})]
    assert [[t.id for t in answer.tokens] for answer in streamed] == want_ids
    for skip in (True, False):
        got_text = tokenize.Decode(
            pb.DecodeRequest(ids=want_ids[0], skip_special_tokens=skip), metadata=AUTH
        )
        body = {"ids": want_ids[0], "skip_special_tokens": skip}
        assert got_text.text == _post(http, "/decode", body)[0]
    decoded = list(
        tokenize.DecodeStream(
            iter([pb.DecodeRequest(ids=ids, skip_special_tokens=True) for ids in want_ids]),
            metadata=AUTH,
        )
    )
    assert [d.text for d in decoded] == _post(http, "/decode", {"ids": want_ids})


def test_info_equals_tei_http(stubs: Any, channel: grpc.Channel, http: httpx.Client) -> None:
    pb, pb_grpc = stubs
    info = pb_grpc.InfoStub(channel).Info(pb.InfoRequest(), metadata=AUTH)
    want = http.get("/info").json()
    assert info.model_id == want["model_id"]
    assert info.model_type == pb.MODEL_TYPE_EMBEDDING
    assert info.max_input_length == want["max_input_length"]
    assert info.max_batch_tokens == want["max_batch_tokens"]
    reranker = pb_grpc.InfoStub(channel).Info(pb.InfoRequest(), metadata=RERANKER)
    assert reranker.model_type == pb.MODEL_TYPE_RERANKER


def test_rerank_and_predict_on_the_model_the_metadata_names(
    stubs: Any, channel: grpc.Channel, http: httpx.Client
) -> None:
    pb, pb_grpc = stubs
    body = {"model": "reranker", "query": QUERY, "documents": DOCUMENTS}
    want = {r["index"]: r["relevance_score"] for r in _post(http, "/rerank", body)["results"]}
    request = pb.RerankRequest(query=QUERY, texts=DOCUMENTS, return_text=True)
    ranked = pb_grpc.RerankStub(channel).Rerank(request, metadata=RERANKER)
    assert [r.index for r in ranked.ranks] == sorted(want, key=want.__getitem__, reverse=True)
    for rank in ranked.ranks:
        assert rank.text == DOCUMENTS[rank.index]
        assert abs(rank.score - want[rank.index]) < 1e-5
    messages = [pb.RerankStreamRequest(query=QUERY, text=d) for d in DOCUMENTS]
    streamed = pb_grpc.RerankStub(channel).RerankStream(iter(messages), metadata=RERANKER)
    assert [(r.index, r.score) for r in streamed.ranks] == [
        (r.index, r.score) for r in ranked.ranks
    ]
    assert not any(r.HasField("text") for r in streamed.ranks)
    predict = pb_grpc.PredictStub(channel)
    pairs = [pb.PredictPairRequest(inputs=[QUERY, d]) for d in DOCUMENTS]
    one = predict.PredictPair(pairs[0], metadata=RERANKER)
    assert one.predictions[0].label == "LABEL_0"
    assert abs(one.predictions[0].score - want[0]) < 1e-5
    for index, answer in enumerate(predict.PredictPairStream(iter(pairs), metadata=RERANKER)):
        assert abs(answer.predictions[0].score - want[index]) < 1e-5
    texts = [pb.PredictRequest(inputs=t) for t in DOCUMENTS]
    singles = list(predict.PredictStream(iter(texts), metadata=RERANKER))
    classified = _post(http, "/classify", {"model": "reranker", "input": DOCUMENTS})["data"]
    for answer, row in zip(singles, classified, strict=True):
        assert abs(answer.predictions[0].score - row["probs"][0]) < 1e-5
    raw = predict.Predict(
        pb.PredictRequest(inputs=DOCUMENTS[0], raw_scores=True), metadata=RERANKER
    )
    assert abs(1 / (1 + np.exp(-raw.predictions[0].score)) - singles[0].predictions[0].score) < 1e-5


def _code(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return raised.value.code(), raised.value.details()


def test_errors_take_grpc_codes(stubs: Any, channel: grpc.Channel, http: httpx.Client) -> None:
    pb, pb_grpc = stubs
    embed = pb_grpc.EmbedStub(channel)
    code, message = _code(lambda: embed.Embed(pb.EmbedRequest(inputs="a")))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    wrong = (("authorization", "Bearer nope"),)
    assert _code(lambda: embed.Embed(pb.EmbedRequest(inputs="a"), metadata=wrong))[0] == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    code, message = _code(lambda: embed.Embed(pb.EmbedRequest(inputs=""), metadata=AUTH))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message == "`inputs` cannot be empty"
    assert http.post("/embed", json={"inputs": ""}).json()["error"] == message
    missing = (*AUTH, ("model", "no-such-model"))
    code, message = _code(lambda: embed.Embed(pb.EmbedRequest(inputs="a"), metadata=missing))
    assert code == grpc.StatusCode.NOT_FOUND and "no-such-model" in message
    # over the model's length with truncate false (proto3's default): refused, as TEI does
    long = pb.EmbedRequest(inputs=LONG * 4)
    assert _code(lambda: embed.Embed(long, metadata=AUTH))[0] == grpc.StatusCode.INVALID_ARGUMENT
    truncated = embed.Embed(pb.EmbedRequest(inputs=LONG * 4, truncate=True), metadata=AUTH)
    assert len(truncated.embeddings) == 384
    # a task the model lacks: TEI's Backend error
    code, _ = _code(lambda: embed.Embed(pb.EmbedRequest(inputs="a"), metadata=RERANKER))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    dims = pb.EmbedRequest(inputs="a", dimensions=0)
    assert _code(lambda: embed.Embed(dims, metadata=AUTH))[0] == grpc.StatusCode.INVALID_ARGUMENT
    tokens = pb_grpc.TokenizeStub(channel)
    bad_ids = pb.DecodeRequest(ids=[10**7])
    code, message = _code(lambda: tokens.Decode(bad_ids, metadata=AUTH))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in message
    # one failing message ends its stream with that message's code
    messages = iter([pb.EmbedRequest(inputs="fine"), pb.EmbedRequest(inputs="")])
    code, _ = _code(lambda: list(embed.EmbedStream(messages, metadata=AUTH)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_health_and_reflection(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "tei.v1.Embed"):
        answer = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    asked = reflection_pb2.ServerReflectionRequest(list_services="")
    answer = next(iter(reflect.ServerReflectionInfo(iter([asked]))))
    names = {s.name for s in answer.list_services_response.service}
    assert {"tei.v1.Embed", "tei.v1.Rerank", "grpc.health.v1.Health"} <= names


def _samples(http: httpx.Client, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for line in http.get("/metrics").text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line[: line.rindex("}")]))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _engine_idle(http: httpx.Client) -> bool:
    busy = _samples(http, "poolserve_waiting_requests") + _samples(
        http, "poolserve_running_requests"
    )
    return busy == 0


def _wait(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_grpc_and_http_calls_count_under_their_own_protocol(
    stubs: Any, channel: grpc.Channel, http: httpx.Client
) -> None:
    pb, pb_grpc = stubs
    endpoints = [(p, e) for p in ("grpc", "http") for e in ("/tei.v1.Embed/Embed", "/embed")]

    def scrape() -> dict[tuple[str, ...], float]:
        counted = {
            (protocol, endpoint, status): _samples(
                http,
                "poolserve_requests_total",
                protocol=protocol,
                endpoint=endpoint,
                status=status,
            )
            for protocol, endpoint in endpoints
            for status in ("200", "400")
        }
        timed = {
            (protocol, endpoint): _samples(
                http,
                "poolserve_request_duration_seconds_count",
                protocol=protocol,
                endpoint=endpoint,
            )
            for protocol, endpoint in endpoints
        }
        return {**counted, **timed}

    before = scrape()
    embed = pb_grpc.EmbedStub(channel)
    assert len(embed.Embed(pb.EmbedRequest(inputs="a sentence"), metadata=AUTH).embeddings)
    with pytest.raises(grpc.RpcError):  # an error counts under its protocol too (400)
        embed.Embed(pb.EmbedRequest(inputs=""), metadata=AUTH)
    assert http.post("/embed", json={"inputs": "a sentence"}).status_code == 200
    after = scrape()
    grew = {key: after[key] - before[key] for key in after if after[key] != before[key]}
    # each transport's calls under its own label only, and their latencies beside them
    assert grew == {
        ("grpc", "/tei.v1.Embed/Embed", "200"): 1,
        ("grpc", "/tei.v1.Embed/Embed", "400"): 1,
        ("grpc", "/tei.v1.Embed/Embed"): 2,
        ("http", "/embed", "200"): 1,
        ("http", "/embed"): 1,
    }


def test_cancelling_a_stream_frees_its_requests(
    stubs: Any, channel: grpc.Channel, http: httpx.Client
) -> None:
    pb, pb_grpc = stubs
    _wait(lambda: _engine_idle(http))
    endpoint = "/tei.v1.Embed/EmbedStream"
    before = _samples(http, "poolserve_requests_total", endpoint=endpoint, status="499")
    messages = iter([pb.EmbedRequest(inputs=LONG, truncate=True) for _ in range(200)])
    stream = pb_grpc.EmbedStub(channel).EmbedStream(messages, metadata=AUTH)
    next(stream)  # the engine is at work on the rest
    stream.cancel()
    _wait(lambda: _engine_idle(http))
    cancelled = _samples(http, "poolserve_requests_total", endpoint=endpoint, status="499")
    assert cancelled > before  # requests were cut short, not run to the end


def test_a_client_that_does_not_read_holds_a_bounded_stream(
    stubs: Any, server: tuple[httpx.Client, int], http: httpx.Client
) -> None:
    pb, pb_grpc = stubs
    # BDP probing off: the window stays at HTTP/2's 64 KiB, so the bound shows quickly
    options = [("grpc.http2.bdp_probe", 0)]
    endpoint = "/tei.v1.Embed/EmbedStream"
    sent = 0
    lock = threading.Lock()

    def requests() -> Iterator[Any]:
        nonlocal sent
        for _ in range(10_000):
            with lock:
                sent += 1
            yield pb.EmbedRequest(inputs=PAGE, truncate=True)

    with grpc.insecure_channel(f"127.0.0.1:{server[1]}", options=options) as channel:
        start = _samples(http, "poolserve_requests_total", endpoint=endpoint)
        stream = pb_grpc.EmbedStub(channel).EmbedStream(requests(), metadata=AUTH)  # never read
        answered = [-1.0]

        def settled() -> bool:
            now = _samples(http, "poolserve_requests_total", endpoint=endpoint) - start
            same, answered[0] = now == answered[0], now
            time.sleep(0.5)
            return same and now > 0

        _wait(settled)
        # answers wait for a reader: the server reads no further than its stream bound allows,
        # and HTTP/2's flow control holds the writer back (10,000 pages are 20 MB)
        print(f"answered {answered[0]:.0f}, sent {sent}")
        assert answered[0] <= 200
        with lock:
            assert sent < 10_000
        stream.cancel()
    _wait(lambda: _engine_idle(http))


def test_tls_and_health_following_readiness(tmp_path: Path) -> None:
    """The gRPC port speaks TLS with --ssl-keyfile/--ssl-certfile; health says NOT_SERVING until
    the server is ready and again once it leaves (a SIGTERM's drain). The server state is driven
    by lines on the process's stdin: no model is loaded."""
    from tests.config.test_operator_flags import self_signed_pair

    key, cert = self_signed_pair(tmp_path)
    port = free_port()
    script = f"""
import asyncio, sys
from poolserve.config.settings import ServerSettings
from poolserve.frontend.state import ServiceState
from poolserve.grpc.server import serving_grpc
from poolserve.observability.metrics import ServiceMetrics

async def main():
    settings = ServerSettings(
        grpc_port={port}, ssl_keyfile={str(key)!r}, ssl_certfile={str(cert)!r}
    )
    state = ServiceState(settings=settings, metrics=ServiceMetrics())
    async with serving_grpc(state):
        print("up", flush=True)
        while line := await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline):
            setattr(state, line.strip(), True)

asyncio.run(main())
"""
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == b"up"
        assert process.stdin is not None
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{port}", credentials) as secure:
            health = health_pb2_grpc.HealthStub(secure)

            def status() -> int:
                asked = health_pb2.HealthCheckRequest(service="tei.v1.Embed")
                return int(health.Check(asked, timeout=30).status)

            assert status() == health_pb2.HealthCheckResponse.NOT_SERVING  # not ready yet
            for line, want in (
                (b"ready\n", health_pb2.HealthCheckResponse.SERVING),
                (b"leaving\n", health_pb2.HealthCheckResponse.NOT_SERVING),
            ):
                process.stdin.write(line)
                process.stdin.flush()
                _wait(lambda want=want: status() == want, timeout_s=10)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as plain, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(plain).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
    finally:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(timeout=30)


def test_a_taken_grpc_port_is_said_before_any_model_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        command = [sys.executable, "-m", "poolserve", "serve", "--port", str(free_port())]
        done = subprocess.run(
            [*command, "--grpc-port", str(busy), "--api-server-count", "0"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        f"poolserve serve: error: --grpc-port: 127.0.0.1:{busy} is already in use: stop what "
        "listens there or pick --grpc-port"
    )
