"""The port is the server's alone: anything listening there, even with SO_REUSEPORT, makes
`poolserve serve` refuse in one line before any model loads, whatever --api-server-count."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest


@pytest.mark.parametrize("api_server_count", [0, 1, 2])
def test_a_port_in_use_is_refused_in_one_line(api_server_count: int) -> None:
    with socket.socket() as other:
        # another server that would share the port with ours if ours set SO_REUSEPORT blindly
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        command = [sys.executable, "-m", "poolserve", "serve", "--port", str(port)]
        command += ["--api-server-count", str(api_server_count), "--model", "/never/read"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"poolserve serve: error: 127.0.0.1:{port} is already in use: stop what listens there "
        "or pick --port"
    )
