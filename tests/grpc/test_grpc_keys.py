"""--api-keys-file on the gRPC side, on the package's one real server (tests/grpc/serving.py): the
keys, buckets and counters the HTTP edge of the same front end uses. UNAUTHENTICATED for a
missing or unknown key, PERMISSION_DENIED for a method its `routes` leave out (a call's route is
its method path) or a model its `models` leave out, RESOURCE_EXHAUSTED with `retry-after`
trailing metadata when its requests per second are spent or its prompt tokens in debt; each
stream message is one request, and a stream ends at the message that finds the bucket empty.
Counted per key name in the metrics and the access log; a SIGHUP reloads the table for both
transports.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import grpc
import httpx
import pytest

from tests.grpc.serving import API_KEY, KEYS_FILE, SECRETS, GrpcServer

pytestmark = pytest.mark.slow
RETRY_AFTER = "retry-after"


def _auth(name: str, *more: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {SECRETS[name]}"), *more)


def _refused(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return raised.value


def _sample(http: httpx.Client, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + "{"):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line[: line.rindex("}")]))
            if all(found.get(k) == v for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _retry_after(error: grpc.RpcError) -> int:
    trailers = dict(error.trailing_metadata() or ())  # type: ignore[attr-defined]
    return int(trailers[RETRY_AFTER])


def test_a_good_key_is_served_and_counted_on_both_transports(
    stubs: Any, channel: grpc.Channel, grpc_server: GrpcServer
) -> None:
    pb, pb_grpc = stubs
    http = grpc_server.http
    before = _sample(http, "poolserve_api_key_requests_total", key="embedder")
    embed = pb_grpc.EmbedStub(channel)
    answer = embed.Embed(pb.EmbedRequest(inputs="a sentence"), metadata=_auth("embedder"))
    assert len(answer.embeddings) == 384
    streamed = embed.EmbedStream(
        iter([pb.EmbedRequest(inputs=t) for t in ("one", "two")]), metadata=_auth("embedder")
    )
    assert len(list(streamed)) == 2
    headers = {"Authorization": f"Bearer {SECRETS['embedder']}"}
    assert http.post("/embed", json={"inputs": "a"}, headers=headers).status_code == 200
    # one unary call, two stream messages, one HTTP request: one table, one counter
    assert _sample(http, "poolserve_api_key_requests_total", key="embedder") == before + 4
    tokens = _sample(http, "poolserve_api_key_prompt_tokens_total", key="embedder")
    assert tokens >= answer.metadata.compute_tokens > 0
    deadline = time.monotonic() + 10
    while not [
        line
        for line in grpc_server.log.read_text().splitlines()
        if "/tei.v1.Embed/EmbedStream 200" in line and "key=embedder" in line
    ]:
        assert time.monotonic() < deadline, "no access log line names the key"
        time.sleep(0.1)
    assert SECRETS["embedder"] not in grpc_server.log.read_text()


def test_a_missing_or_unknown_key_is_unauthenticated(stubs: Any, channel: grpc.Channel) -> None:
    pb, pb_grpc = stubs
    embed = pb_grpc.EmbedStub(channel)
    for metadata in ((), (("authorization", "Bearer sk-nope"),), (("authorization", "sk"),)):
        error = _refused(lambda m=metadata: embed.Embed(pb.EmbedRequest(inputs="a"), metadata=m))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    stream = embed.EmbedStream(iter([pb.EmbedRequest(inputs="a")]))
    assert _refused(lambda: list(stream)).code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_method_the_routes_leave_out_is_permission_denied(
    stubs: Any, channel: grpc.Channel, http: httpx.Client
) -> None:
    pb, pb_grpc = stubs
    tokenize = pb_grpc.TokenizeStub(channel)
    embedder = _auth("embedder")
    error = _refused(lambda: tokenize.Tokenize(pb.EncodeRequest(inputs="a"), metadata=embedder))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error.details() == "this API key may not use /tei.v1.Tokenize/Tokenize"
    info = _refused(lambda: pb_grpc.InfoStub(channel).Info(pb.InfoRequest(), metadata=embedder))
    assert info.code() == grpc.StatusCode.PERMISSION_DENIED
    refused = _sample(
        http, "poolserve_api_key_rejected_requests_total", key="embedder", reason="route"
    )
    assert refused >= 2


def test_a_model_the_key_may_not_use_is_permission_denied(
    stubs: Any, channel: grpc.Channel, http: httpx.Client
) -> None:
    pb, pb_grpc = stubs
    embed = pb_grpc.EmbedStub(channel)
    error = _refused(lambda: embed.Embed(pb.EmbedRequest(inputs="a"), metadata=_auth("reranking")))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "may not use the model" in error.details()
    assert (
        _sample(http, "poolserve_api_key_rejected_requests_total", key="reranking", reason="model")
        >= 1
    )
    # a name no model is served under: NOT_FOUND in words that list no served model, as HTTP's
    unknown = _auth("reranking", ("model", "no-such-model"))
    error = _refused(lambda: embed.Embed(pb.EmbedRequest(inputs="a"), metadata=unknown))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details() == "model 'no-such-model' does not exist or this API key may not use it"
    reranker = _auth("reranking", ("model", "reranker"))
    ranked = pb_grpc.RerankStub(channel).Rerank(
        pb.RerankRequest(query="q", texts=["a", "b"]), metadata=reranker
    )
    assert len(ranked.ranks) == 2


def test_info_names_only_a_model_the_key_may_use(
    stubs: Any, channel: grpc.Channel, http: httpx.Client
) -> None:
    pb, pb_grpc = stubs
    info = pb_grpc.InfoStub(channel).Info
    default = http.get("/info").json()["model_id"]  # the `default` key may use every model
    everything = (("authorization", f"Bearer {API_KEY}"),)
    assert info(pb.InfoRequest(), metadata=everything).model_id == default
    # `reranking` may use the reranker only: the default model is not served to it, and a
    # model it may not use answers as an unknown name does; each as HTTP's /info answers it
    reranker = info(pb.InfoRequest(), metadata=_auth("reranking", ("model", "reranker")))
    assert reranker.model_type == pb.MODEL_TYPE_RERANKER
    headers = {"Authorization": f"Bearer {SECRETS['reranking']}"}
    details = {}
    for name in (None, "splade", "no-such-model"):
        metadata = _auth("reranking") if name is None else _auth("reranking", ("model", name))
        error = _refused(lambda metadata=metadata: info(pb.InfoRequest(), metadata=metadata))
        assert error.code() == grpc.StatusCode.NOT_FOUND, name
        refused = http.get("/info", params={} if name is None else {"model": name}, headers=headers)
        assert refused.status_code == 404, name
        assert error.details() == refused.json()["error"]["message"], name
        details[name] = error.details().replace(name or "", "NAME")
    assert details["splade"] == details["no-such-model"]
    assert "reranker" not in details[None] + details["no-such-model"]  # no served name listed


def test_a_spent_request_bucket_is_resource_exhausted_with_retry_after(
    stubs: Any, channel: grpc.Channel, http: httpx.Client
) -> None:
    pb, pb_grpc = stubs
    embed = pb_grpc.EmbedStub(channel)
    for _ in range(2):  # the burst
        embed.Embed(pb.EmbedRequest(inputs="a"), metadata=_auth("rps"))
    error = _refused(lambda: embed.Embed(pb.EmbedRequest(inputs="a"), metadata=_auth("rps")))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "requests_per_second" in error.details()
    assert 1 <= _retry_after(error) <= 100  # 0.01 a second: a request every 100 s
    assert _sample(http, "poolserve_api_key_requests_total", key="rps") == 3
    series = "poolserve_api_key_rejected_requests_total"
    assert _sample(http, series, key="rps", reason="requests_per_second") == 1
    # the HTTP side of the same front end finds the same bucket empty
    headers = {"Authorization": f"Bearer {SECRETS['rps']}"}
    refused = http.post("/embed", json={"inputs": "a"}, headers=headers)
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1


def test_prompt_tokens_are_charged_then_the_debt_is_resource_exhausted(
    stubs: Any, channel: grpc.Channel, http: httpx.Client
) -> None:
    pb, pb_grpc = stubs
    embed = pb_grpc.EmbedStub(channel)
    long = " ".join(f"word{i}" for i in range(40))  # more tokens than a minute's 12
    answer = embed.Embed(pb.EmbedRequest(inputs=long), metadata=_auth("tokens"))
    charged = _sample(http, "poolserve_api_key_prompt_tokens_total", key="tokens")
    assert charged == answer.metadata.compute_tokens > 12
    error = _refused(lambda: embed.Embed(pb.EmbedRequest(inputs="a"), metadata=_auth("tokens")))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tokens_per_minute" in error.details()
    assert _retry_after(error) >= 1
    series = "poolserve_api_key_rejected_requests_total"
    assert _sample(http, series, key="tokens", reason="tokens_per_minute") == 1


def test_a_stream_ends_at_the_message_that_finds_the_bucket_empty(
    stubs: Any, channel: grpc.Channel, http: httpx.Client
) -> None:
    pb, pb_grpc = stubs
    messages = iter([pb.EmbedRequest(inputs=f"message {i}") for i in range(6)])
    stream = pb_grpc.EmbedStub(channel).EmbedStream(messages, metadata=_auth("streamer"))
    answers: list[Any] = []
    error = _refused(lambda: answers.extend(stream))
    assert len(answers) == 3  # the burst's messages are answered, in order, before the refusal
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _retry_after(error) >= 1
    assert _sample(http, "poolserve_api_key_requests_total", key="streamer") >= 4
    assert (
        _sample(
            http,
            "poolserve_api_key_rejected_requests_total",
            key="streamer",
            reason="requests_per_second",
        )
        >= 1
    )


def test_sighup_reloads_the_keys_of_both_transports(
    stubs: Any, channel: grpc.Channel, grpc_server: GrpcServer
) -> None:
    pb, pb_grpc = stubs
    info = pb_grpc.InfoStub(channel)

    def code(name: str) -> grpc.StatusCode:
        try:
            info.Info(pb.InfoRequest(), metadata=_auth(name))
        except grpc.RpcError as error:
            return error.code()  # type: ignore[attr-defined,no-any-return]
        return grpc.StatusCode.OK

    def until(name: str, want: grpc.StatusCode) -> None:
        deadline = time.monotonic() + 20
        while code(name) != want:
            assert time.monotonic() < deadline, f"{name} is not {want} yet"
            time.sleep(0.1)

    assert code("late") == grpc.StatusCode.UNAUTHENTICATED
    try:
        grpc_server.hang_up(KEYS_FILE + f"  - name: late\n    key: {SECRETS['late']}\n")
        until("late", grpc.StatusCode.OK)
        headers = {"Authorization": f"Bearer {SECRETS['late']}"}
        assert grpc_server.http.get("/info", headers=headers).status_code == 200
    finally:
        grpc_server.hang_up(KEYS_FILE)
    until("late", grpc.StatusCode.UNAUTHENTICATED)
    assert grpc_server.process.poll() is None
