"""What the gRPC tests' one real server process is: `poolserve serve MINILM RERANKER SPLADE
--grpc-port P --api-key K --api-keys-file F` (started in tests/grpc/conftest.py).

The bundled MiniLM is the default model (TEI's HTTP routes); a tiny cross-encoder and a tiny
SPLADE model are picked with the `model` metadata. `--api-key` is the keys file's unlimited
`default` key, which every test but the keys file's own calls with.
"""

from __future__ import annotations

import hashlib
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "grpc-test-key"
# the keys of --api-keys-file, by name
SECRETS = {
    "embedder": "sk-grpc-embedder-0123",
    "reranking": "sk-grpc-reranking-0123",
    "rps": "sk-grpc-rps-0123",
    "streamer": "sk-grpc-streamer-0123",
    "tokens": "sk-grpc-tokens-0123",
    "late": "sk-grpc-late-0123",  # only in the file a reload reads
}
KEYS_FILE = f"""
keys:
  - name: embedder
    key: sha256:{hashlib.sha256(SECRETS["embedder"].encode()).hexdigest()}
    routes: [/tei.v1.Embed, /embed]
  - name: reranking
    key: {SECRETS["reranking"]}
    models: [reranker]
  - name: rps
    key: {SECRETS["rps"]}
    requests_per_second: 0.01
    burst: 2
  - name: streamer
    key: {SECRETS["streamer"]}
    requests_per_second: 0.01
    burst: 3
  - name: tokens
    key: {SECRETS["tokens"]}
    tokens_per_minute: 12
"""


@dataclass(frozen=True)
class GrpcServer:
    """The server process, its HTTP client, its gRPC port, its keys file and its log."""

    process: subprocess.Popen[bytes]
    http: httpx.Client
    port: int
    keys: Path
    log: Path

    def hang_up(self, keys_file: str) -> None:
        """Write the keys file and send SIGHUP (the supervisor passes it to the front end)."""
        self.keys.write_text(keys_file)
        self.process.send_signal(signal.SIGHUP)
