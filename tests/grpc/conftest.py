"""The gRPC tests' fixtures: one real server process for the package (tests/grpc/serving.py
says what it serves), and a client compiled here from the project's poolserve/grpc/tei.proto as a
TEI user compiles TEI's."""

from __future__ import annotations

import importlib
import signal
import sys
from collections.abc import Iterator
from types import ModuleType

import grpc
import httpx
import pytest

from tests.grpc.serving import API_KEY, KEYS_FILE, ROOT, GrpcServer
from tests.http.test_server_process import free_port, start_server
from tests.tiny_encoders import save_tiny_encoder
from tests.tiny_models import MINILM_DIR
from tests.tiny_rerankers import save_cross_encoder


@pytest.fixture(scope="package")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModuleType, ModuleType]:
    """tei_pb2 and tei_pb2_grpc compiled from the project's proto, as a client compiles TEI's."""
    out = tmp_path_factory.mktemp("stubs")
    proto_dir = ROOT / "poolserve" / "grpc"
    from grpc_tools import protoc

    code = protoc.main(
        [
            "protoc",
            f"-I{proto_dir}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            str(proto_dir / "tei.proto"),
        ]
    )
    assert code == 0
    sys.path.insert(0, str(out))
    try:
        return importlib.import_module("tei_pb2"), importlib.import_module("tei_pb2_grpc")
    finally:
        sys.path.remove(str(out))


@pytest.fixture(scope="package")
def grpc_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcServer]:
    """The server, started once for every gRPC test that needs one."""
    models = tmp_path_factory.mktemp("grpc")
    reranker = save_cross_encoder("bert_cls", models / "reranker")
    splade = save_tiny_encoder("bert_mlm", models / "splade")
    keys, log = models / "keys.yaml", models / "server.log"
    keys.write_text(KEYS_FILE)
    port, grpc_port = free_port(), free_port()
    args = (str(MINILM_DIR), str(reranker), str(splade), "--api-server-count", "1")
    args += ("--grpc-port", str(grpc_port), "--api-key", API_KEY, "--api-keys-file", str(keys))
    process = start_server(port, *args, log=log)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            http.headers["Authorization"] = f"Bearer {API_KEY}"
            yield GrpcServer(process, http, grpc_port, keys, log)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except Exception:
            process.kill()


@pytest.fixture(scope="package")
def server(grpc_server: GrpcServer) -> tuple[httpx.Client, int]:
    """The server's HTTP client (with the `default` key) and its gRPC port."""
    return grpc_server.http, grpc_server.port


@pytest.fixture(scope="package")
def channel(grpc_server: GrpcServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{grpc_server.port}") as opened:
        yield opened


@pytest.fixture(scope="package")
def http(grpc_server: GrpcServer) -> httpx.Client:
    return grpc_server.http
