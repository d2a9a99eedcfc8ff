"""Operator's flags on real processes: TLS, --root-path, aliases, CORS, /version, make serve."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from poolserve.config.model_path import resolve_model_path
from poolserve.frontend.jobs import Truncate
from poolserve.frontend.texts import Truncation, truncation_for
from tests.deploy.live import (
    SERVER_READY_TIMEOUT_S,
    LiveProcess,
    log_tail,
    server_command,
    server_env,
    started,
    wait_ready,
)
from tests.deploy.tools import free_port, require_tool

pytestmark = pytest.mark.slow
ALLOWED = "https://app.example"
OTHER = "https://elsewhere.example"
NAMES = ("embedder", "minilm-alias")
PREFIX = "/poolserve"
API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@dataclass(frozen=True)
class TLSServer:
    """A poolserve process answering https with a certificate only `trusting` verifies."""

    base_url: str
    trusting: ssl.SSLContext
    log_path: Path


def self_signed_pair(directory: Path) -> tuple[Path, Path]:
    """A throwaway key and certificate for 127.0.0.1, made by the openssl CLI."""
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(
        [
            require_tool("openssl"),
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return key, cert


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSServer]:
    """One server with TLS, a root path, two names, CORS for one origin and an API key."""
    workdir = tmp_path_factory.mktemp("tls")
    key, cert = self_signed_pair(workdir)
    port = free_port()
    args = [
        *server_command(port),
        "--ssl-keyfile",
        str(key),
        "--ssl-certfile",
        str(cert),
        "--root-path",
        PREFIX,
        "--served-model-name",
        *NAMES,
        "--allowed-origins",
        f'["{ALLOWED}"]',
        "--api-key",
        API_KEY,
    ]
    log = workdir / "poolserve.log"
    trusting = ssl.create_default_context(cafile=str(cert))
    base = f"https://127.0.0.1:{port}"
    with started("poolserve", args, server_env(), log) as process:
        live = LiveProcess("poolserve", base, log)
        wait_ready(process, live, "/ready", SERVER_READY_TIMEOUT_S, trusting)
        yield TLSServer(base, trusting, log)


def test_tls_answers_https_to_a_client_trusting_the_certificate(tls_server: TLSServer) -> None:
    response = httpx.get(tls_server.base_url + "/health", verify=tls_server.trusting)
    assert response.status_code == 200 and response.json() == {"status": "ok"}
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(tls_server.base_url + "/health")  # the system's CAs do not know this one
    with pytest.raises(httpx.TransportError):
        httpx.get(tls_server.base_url.replace("https", "http", 1) + "/health", timeout=5)


def test_aliases_all_accepted_the_first_reported(tls_server: TLSServer) -> None:
    with httpx.Client(base_url=tls_server.base_url, verify=tls_server.trusting, headers=AUTH) as c:
        listed = c.get("/v1/models").json()["data"]
        assert [card["id"] for card in listed] == list(NAMES)
        assert {card["root"] for card in listed} == {"sentence-transformers/all-MiniLM-L6-v2"}
        for name in NAMES:
            answer = c.post("/v1/embeddings", json={"model": name, "input": "hello"})
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == NAMES[0]
        unknown = c.post("/v1/embeddings", json={"model": "other", "input": "hello"})
        assert unknown.status_code == 404
        assert all(name in unknown.json()["error"]["message"] for name in NAMES)


def test_root_path_serves_under_the_prefix_too(tls_server: TLSServer) -> None:
    with httpx.Client(base_url=tls_server.base_url, verify=tls_server.trusting, headers=AUTH) as c:
        # a proxy that strips the prefix sends the bare path; one that keeps it, the full one
        assert c.get("/v1/models").status_code == 200
        assert c.get(PREFIX + "/v1/models").status_code == 200
        assert c.get("/elsewhere/v1/models").status_code == 404
    # probes, metrics and the version stay open under the prefix; the rest still wants the key
    with httpx.Client(base_url=tls_server.base_url, verify=tls_server.trusting) as c:
        for path in ("/health", "/ready", "/metrics", "/version"):
            assert c.get(PREFIX + path).status_code == 200, path
            assert c.get(path).status_code == 200, path
        assert c.get(PREFIX + "/v1/models").status_code == 401


def test_cors_preflight_answered_for_the_allowed_origin_only(tls_server: TLSServer) -> None:
    def preflight(origin: str) -> httpx.Response:
        headers = {
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        return httpx.options(
            tls_server.base_url + "/v1/embeddings", headers=headers, verify=tls_server.trusting
        )

    allowed = preflight(ALLOWED)  # no API key: a browser's preflight never carries one
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in allowed.headers["access-control-allow-methods"]
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    refused = preflight(OTHER)
    assert "access-control-allow-origin" not in refused.headers
    # the actual request from the allowed origin carries the header too, the other's does not
    for origin, expected in ((ALLOWED, ALLOWED), (OTHER, None)):
        answer = httpx.post(
            tls_server.base_url + "/v1/embeddings",
            json={"input": "hello"},
            headers={**AUTH, "Origin": origin},
            verify=tls_server.trusting,
        )
        assert answer.status_code == 200
        assert answer.headers.get("access-control-allow-origin") == expected


def test_version_route_and_flag_report_the_package_version(tls_server: TLSServer) -> None:
    answer = httpx.get(tls_server.base_url + "/version", verify=tls_server.trusting)  # open
    assert answer.json() == {"version": version("poolserve")}
    printed = subprocess.run(
        [sys.executable, "-m", "poolserve", "--version"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert printed.stdout.strip() == version("poolserve")


def _descendants(pid: int) -> list[int]:
    """Children, grandchildren, ... of a process (Linux /proc)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    children = [int(p) for p in path.read_text().split()] if path.exists() else []
    return [pid for child in children for pid in (child, *_descendants(child))]


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_sigterm_to_make_serve_stops_the_server_and_frees_the_port(tmp_path: Path) -> None:
    make = require_tool("make")
    venv = Path(sys.executable).parent.parent
    if not (venv / "bin" / "poolserve").exists():
        pytest.skip(f"no poolserve script in {venv}: make serve needs the installed venv")
    port = free_port()
    env = {**server_env(), "POOLSERVE_PORT": str(port)}
    # -o: the venv is there already; never reinstall it from a test
    args = [make, "-s", "-o", f"{venv}/.installed", "serve", f"VENV={venv}"]
    log = tmp_path / "make-serve.log"
    base = f"http://127.0.0.1:{port}"
    with started("make serve", args, env, log) as process:
        wait_ready(process, LiveProcess("make serve", base, log), "/ready", SERVER_READY_TIMEOUT_S)
        server_pids = _descendants(process.pid)
        # no --allowed-origins: CORS denies by default, preflights get no CORS headers
        preflight = httpx.options(
            base + "/v1/embeddings",
            headers={"Origin": ALLOWED, "Access-Control-Request-Method": "POST"},
        )
        assert "access-control-allow-origin" not in preflight.headers
        os.kill(process.pid, signal.SIGTERM)  # make's pid alone, as a supervisor would
        process.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not _port_free(port) and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = [pid for pid in server_pids if Path(f"/proc/{pid}").exists()]
        for pid in survivors:
            os.kill(pid, signal.SIGKILL)  # the failure case: do not leave it running
        assert not survivors, f"server outlived make; log tail:\n{log_tail(log)}"
        assert _port_free(port), f"port {port} still taken; log tail:\n{log_tail(log)}"


def test_revision_picks_that_snapshot_from_the_hub_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two cached commits of one repo: --revision chooses, no revision means main."""
    from huggingface_hub import constants

    repo = tmp_path / "models--org--tiny"
    commits = {"main": "a" * 40, "pinned": "b" * 40}
    for commit in commits.values():
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commits["main"])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshots = repo / "snapshots"
    assert resolve_model_path("org/tiny") == snapshots / commits["main"]
    assert resolve_model_path("org/tiny", commits["pinned"]) == snapshots / commits["pinned"]
    assert resolve_model_path("org/tiny", "main") == snapshots / commits["main"]


@pytest.mark.parametrize("auto_truncate", [False, True])
def test_auto_truncate_cuts_at_the_model_limit(
    make_client: Callable[..., Any], tiny_model_dir: Callable[[str], Path], auto_truncate: bool
) -> None:
    """A tiny model without sentence-transformers' own truncation: refused unless auto-truncated."""
    limit = 16
    text = " ".join(["word"] * 40)
    with make_client("bert", max_model_len=limit, auto_truncate=auto_truncate) as client:
        answer = client.post("/v1/embeddings", json={"input": text})
        if not auto_truncate:
            assert answer.status_code == 400
            assert answer.json()["error"]["code"] == "context_length_exceeded"
            # TEI's routes truncate by default whatever the flag says, as TEI >= 1.9 does
            assert client.post("/embed", json={"inputs": text}).status_code == 200
            return
        assert answer.status_code == 200, answer.text
        # the reference cut: the model's own tokenizer truncating to the limit
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("bert"))
        ids = tokenizer(text, truncation=True, max_length=limit)["input_ids"]
        assert len(ids) == limit
        reference = client.post("/v1/embeddings", json={"input": ids})
        assert answer.json()["usage"]["prompt_tokens"] == limit
        assert answer.json()["data"][0]["embedding"] == reference.json()["data"][0]["embedding"]
        # an explicit request setting still wins over the server-wide default
        shorter = client.post("/v1/embeddings", json={"input": text, "truncate_prompt_tokens": 8})
        assert shorter.json()["usage"]["prompt_tokens"] == 8
        # routes whose clients say truncate or not (TEI's `truncate`) pass it to the same choice
        model = client.app.state.poolserve.model
        assert truncation_for(Truncate(), model).keep == limit
        assert truncation_for(Truncate(auto=False), model).keep is None
        assert truncation_for(Truncate(side="left", auto=True), model) == Truncation(limit, "left")
        # over HTTP: TEI's routes truncate unless the body says truncate: false (TEI >= 1.9)
        embedding = reference.json()["data"][0]["embedding"]
        assert client.post("/embed", json={"inputs": text}).json() == [embedding]
        for route, body in (
            ("/embed", {"inputs": text, "truncate": False}),
            ("/embed_all", {"inputs": text, "truncate": False}),
            ("/rerank", {"query": "q", "texts": [text], "truncate": False}),
        ):
            refused = client.post(route, json=body)
            assert refused.status_code == 422, (route, refused.text)
            assert refused.json()["error_type"] == "Validation", route
        info = client.get("/info").json()
        assert info["auto_truncate"] is True
