"""Every inference route, native or compat, texts or pairs, is accounted the same way.

One request per route, each checked for what the one submit pipeline records: the `tokenize`
and `encode` spans, the prompt tokens on the request span, in the access log and in the
metrics (equal to what the engine was given), the task label, the priority the engine ran it
at, and the request id.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient
from starlette.types import Scope

from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app
from poolserve.observability.logs import ACCESS_LOGGER, FIELDS_ATTR
from poolserve.observability.tracing import SpanRecord
from tests.tiny_encoders import encoder_dirs

A, B, C = "a query about pooling", "a passage on pooling services", "unrelated words here"
TEXTS = [A, B]
PRIORITY = 3  # sent where the route's body takes a priority; others run at 0


@dataclass
class Recorded:
    """What one request's trace was given."""

    spans: list[SpanRecord] = field(default_factory=list)
    attributes: dict[str, Any] = field(default_factory=dict)
    trace_id: str | None = "0" * 32

    def record(self, span: SpanRecord) -> None:
        self.spans.append(span)

    def add_outputs(self, outputs: object) -> None:
        """Engine timelines are not recorded here."""

    def set(self, attributes: Mapping[str, Any]) -> None:
        self.attributes.update(attributes)

    def finish(self, route: str | None, status: int, end: float) -> None:
        """Nothing to export."""


@dataclass
class Recorder:
    """A tracing back end that keeps every request's trace."""

    traces: list[Recorded] = field(default_factory=list)

    def start(
        self, scope: Scope, headers: Mapping[str, str], start: float, request_id: str
    ) -> Recorded:
        self.traces.append(Recorded())
        return self.traces[-1]

    def shutdown(self) -> None:
        """Nothing buffered."""


@dataclass(frozen=True)
class Case:
    """One route, one body, the task label it must carry and whether it takes a priority."""

    path: str
    body: dict[str, Any]
    task: str
    priority: bool = False


EMBEDDER = [
    Case("/v1/embeddings", {"input": TEXTS, "priority": PRIORITY}, "embed", True),
    Case("/v1/pooling", {"input": TEXTS, "priority": PRIORITY}, "embed", True),
    Case("/pooling", {"input": TEXTS, "task": "token_embed"}, "token_embed"),
    Case("/v1/pooling", {"input": TEXTS, "task": "token_embed", "stream": True}, "token_embed"),
    Case("/embed", {"inputs": TEXTS}, "embed"),
    Case("/embed_all", {"inputs": TEXTS}, "token_embed"),
    Case("/similarity", {"inputs": {"source_sentence": A, "sentences": [B, C]}}, "embed"),
    Case("/", {"inputs": TEXTS}, "embed"),
    Case("/", {"query": A, "texts": [B, C]}, "score"),
    Case("/v2/embed", {"texts": TEXTS, "model": "minilm", "priority": PRIORITY}, "embed", True),
    Case("/embeddings", {"input": TEXTS}, "embed"),
    Case("/score", {"text_1": A, "text_2": [B, C], "priority": PRIORITY}, "score", True),
    Case("/v1/score", {"text_1": [A, B], "text_2": [B, C]}, "score"),
    Case("/rerank", {"query": A, "documents": [B, C], "priority": PRIORITY}, "score", True),
    Case("/rerank", {"query": A, "texts": [B, C]}, "score"),
    Case("/rerank", {"query": A, "documents": [B, C], "raw_scores": False}, "score"),
    Case("/v1/rerank", {"query": A, "documents": [B, C], "priority": PRIORITY}, "score", True),
    Case("/v2/rerank", {"query": A, "documents": [B, C]}, "score"),
]
CLASSIFIER = [
    Case("/v1/classify", {"input": TEXTS, "priority": PRIORITY}, "classify", True),
    Case("/classify", {"input": A}, "classify"),
    Case("/predict", {"inputs": [[A], [A, B]]}, "classify"),
    Case("/predict", {"inputs": [A, B]}, "classify"),
    Case("/", {"inputs": A}, "classify"),
]
SPARSE = [
    Case("/embed_sparse", {"inputs": TEXTS}, "embed_sparse"),
    Case("/v1/pooling", {"input": TEXTS, "task": "embed_sparse"}, "embed_sparse"),
]


Counters = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass
class Served:
    """A started app with its trace recorder and what its engine was given."""

    cases: list[Case]
    client: TestClient
    recorder: Recorder
    submitted: list[tuple[int, int]]  # (prompt tokens, priority) per submission


# model (None: the bundled MiniLM) -> the routes it serves
MODELS: dict[str | None, list[Case]] = {None: EMBEDDER, "bert_cls": CLASSIFIER, "bert_mlm": SPARSE}


@pytest.fixture(scope="module", params=list(MODELS))
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    name = request.param
    model = None if name is None else str(encoder_dirs(tmp_path_factory)(name))
    settings = ServerSettings(model=model, served_model_name="minilm")
    with TestClient(create_app(settings)) as client:
        state = client.app.state.poolserve  # type: ignore[attr-defined]
        recorder = Recorder()
        state.tracing = recorder
        submitted: list[tuple[int, int]] = []
        submit_many = state.engine.submit_many

        async def spy(
            prompts: Sequence[Sequence[int]], params: Any, priority: int = 0, *rest: Any
        ) -> Any:
            submitted.append((sum(len(p) for p in prompts), priority))
            return await submit_many(prompts, params, priority, *rest)

        state.engine.submit_many = spy
        yield Served(MODELS[name], client, recorder, submitted)


def _counters(client: TestClient) -> Counters:
    text = client.get("/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_every_inference_route_is_accounted_alike(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    client = served.client
    for number, case in enumerate(served.cases):
        served.recorder.traces.clear()
        served.submitted.clear()
        before = _counters(client)
        request_id = f"route-{number}"
        with caplog.at_level(logging.INFO, ACCESS_LOGGER):
            caplog.clear()
            response = client.post(case.path, json=case.body, headers={"x-request-id": request_id})
            logged = [r for r in caplog.records if r.name == ACCESS_LOGGER]
        where = (case.path, case.body)
        assert response.status_code == 200, (where, response.text)
        after = _counters(client)
        # what the engine was given
        assert served.submitted, where
        num_tokens = sum(tokens for tokens, _ in served.submitted)
        want_priority = PRIORITY if case.priority else 0
        assert {priority for _, priority in served.submitted} == {want_priority}, where
        # the trace: tokenize span(s), the encode span, prompt tokens and task on the request span
        (trace,) = served.recorder.traces
        names = [span.name for span in trace.spans]
        assert names.count("tokenize") == len(served.submitted), (where, names)
        spans = [s for s in trace.spans if s.name == "tokenize"]
        assert sum(s.attributes["poolserve.prompt_tokens"] for s in spans) == num_tokens, where
        if not case.body.get("stream"):
            assert "encode" in names, (where, names)
        assert trace.attributes == {
            "poolserve.model": "minilm",
            "poolserve.prompt_tokens": num_tokens,
            "poolserve.task": case.task,
        }, where
        # the access log line
        (record,) = logged
        fields = getattr(record, FIELDS_ATTR)
        assert fields["prompt_tokens"] == num_tokens, where
        assert fields["model"] == "minilm", where
        assert fields["request_id"] == request_id == response.headers["x-request-id"], where

        # the metrics: prompt tokens, one tokenization per job, the task label
        grew = _growth(before, after)
        model = (("lora_name", ""), ("model_name", "minilm"))
        assert grew("poolserve_prompt_tokens_total", model) == num_tokens, where
        tokenizations = grew("poolserve_tokenization_duration_seconds_count", model)
        assert tokenizations == len(served.submitted), where
        route = (
            ("endpoint", case.path),
            ("lora_name", ""),
            ("model_name", "minilm"),
            ("protocol", "http"),
            ("status", "200"),
            ("task", case.task),
        )
        assert grew("poolserve_requests_total", route) == 1, (where, route)


def _growth(before: Counters, after: Counters) -> Callable[..., float]:
    """name, labels -> how much that sample grew between the two scrapes."""

    def grew(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    return grew
