"""A server that cannot start says why in one line, `poolserve serve: error: ...`, names what
(the model, the flag, the key) and exits 1 at once, whichever process found the problem: the
command line (the models, the files, before any process starts) or the engine core (the
architecture, the device). The traceback shows at --log-level debug only.

Every case runs the real command line; they run side by side (each is a process of its own) so
that the ones that load torch share their wait.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from poolserve.types.model import DEFAULT_MODEL_ID

# After the error line, the whole server is gone within this (the bound).
EXIT_AFTER_ERROR_S = 3.0
ERROR = "poolserve serve: error: "
# A log line under ERROR (the text format's start): everything else the server says is counted.
LOG_BELOW_ERROR = re.compile(r"\d{4}-\d\d-\d\d [\d:,]+ (DEBUG|INFO|WARNING) ")


@dataclass(frozen=True)
class Case:
    args: tuple[str, ...]
    said: str  # what the error line says after ERROR, from its start
    before_any_process: bool  # found by the command line: no server process ever started
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Outcome:
    code: int
    lines: tuple[str, ...]
    error_at: float | None  # when the error line arrived
    exited_at: float


def _cases(tmp: Path) -> dict[str, Case]:
    """Each start-up error, with what the server must say."""
    unsupported = tmp / "unsupported"
    unsupported.mkdir()
    (unsupported / "config.json").write_text('{"architectures": ["FooForBar"]}')
    a_file = tmp / "weights.bin"
    a_file.write_text("not a folder")
    bad_key = tmp / "bad-key.yaml"
    bad_key.write_text(f"models:\n  - model: {DEFAULT_MODEL_ID}\n    colour: 1\n")
    missing = tmp / "missing.yaml"
    missing.write_text(f"models:\n  - model: {tmp / 'gone'}\n")
    pooler = tmp / "pooler.yaml"
    pooler.write_text("models:\n  - served_model_name: mini\n    pooler_config: {bogus: 1}\n")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\nnot one\n-----END CERTIFICATE-----\n")
    key.write_text("not a key\n")
    keys = tmp / "keys.yaml"
    keys.write_text("keys:\n  - name: team-a\n    key: sk-secret\n    requests_per_second: 0\n")
    offline = (("HF_HUB_OFFLINE", "1"), ("HF_HUB_CACHE", str(tmp / "empty-cache")))
    # a closed port: the Hub cannot be reached, at once and on any machine
    unreachable = (
        ("HF_ENDPOINT", "http://127.0.0.1:9"),
        ("HF_HUB_CACHE", str(tmp / "cache")),
        ("HF_HUB_OFFLINE", "0"),
    )
    gone = tmp / "gone"
    cases = {
        "missing folder": Case((str(gone),), f"model {str(gone)!r}: no such folder", True),
        "missing folder, one process": Case(
            (str(gone), "--api-server-count", "0"), f"model {str(gone)!r}: no such folder", True
        ),
        "a file for a folder": Case(
            (str(a_file),), f"model {str(a_file)!r}: a file, not a model folder", True
        ),
        "hub offline, not cached": Case(
            ("no-org/no-model",),
            "model 'no-org/no-model': not in the Hugging Face cache and HF_HUB_OFFLINE is set",
            True,
            offline,
        ),
        "hub unreachable": Case(
            ("no-org/no-model",),
            "model 'no-org/no-model': cannot reach the Hugging Face Hub and it is not in the cache",
            True,
            unreachable,
        ),
        "models file, unknown key": Case(
            ("--models-config", str(bad_key)),
            "--models-config: models[0] (sentence-transformers/all-MiniLM-L6-v2): 'colour' is "
            "not a setting",
            True,
        ),
        "models file, missing model": Case(
            ("--models-config", str(missing)), f"model {str(gone)!r}: no such folder", True
        ),
        "models file, bad pooler config": Case(
            ("--models-config", str(pooler)), "model 'mini': --pooler-config", True
        ),
        "tls files that do not load": Case(
            ("--ssl-certfile", str(cert), "--ssl-keyfile", str(key)),
            f"--ssl-certfile {str(cert)!r} with --ssl-keyfile {str(key)!r}: cannot load them",
            True,
        ),
        "api keys file, bad limit": Case(
            ("--api-keys-file", str(keys)),
            f"--api-keys-file {keys}: keys[0] (team-a).requests_per_second: Input should be "
            "greater than 0",
            True,
        ),
        "core allocator without a core process": Case(
            ("--core-malloc", "tcmalloc", "--api-server-count", "0"),
            "--core-malloc tcmalloc: --api-server-count 0 runs the engine core in this process",
            True,
        ),
        "unsupported architecture": Case(
            (str(unsupported),),
            f"model {str(unsupported)!r}: unsupported architecture 'FooForBar'; supported: ",
            False,
        ),
    }
    if not _has_cuda():
        cases["no cuda device, one process"] = Case(
            ("--device", "cuda", "--api-server-count", "0"),
            "model 'sentence-transformers/all-MiniLM-L6-v2': --device cuda: no CUDA device",
            False,
        )
    return cases


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _run(case: Case) -> Outcome:
    """The real command line, its merged output timed line by line."""
    command = [sys.executable, "-m", "poolserve", "serve", *case.args, "--port", "0"]
    env = {**os.environ, **dict(case.env)}
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert process.stdout is not None
    lines, error_at = [], None
    for line in process.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith(ERROR) and error_at is None:
            error_at = time.monotonic()
    code = process.wait(timeout=180)
    return Outcome(code, tuple(lines), error_at, time.monotonic())


@pytest.fixture(scope="module")
def outcomes(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, tuple[Case, Outcome]]]:
    cases = _cases(tmp_path_factory.mktemp("start-errors"))
    results: dict[str, Outcome] = {}

    def one(name: str) -> None:
        results[name] = _run(cases[name])

    threads = [threading.Thread(target=one, args=(name,)) for name in cases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    yield {name: (cases[name], results[name]) for name in cases}


CASE_NAMES = [
    "missing folder",
    "missing folder, one process",
    "a file for a folder",
    "hub offline, not cached",
    "hub unreachable",
    "models file, unknown key",
    "models file, missing model",
    "models file, bad pooler config",
    "tls files that do not load",
    "api keys file, bad limit",
    "unsupported architecture",
    "no cuda device, one process",
]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_a_start_error_is_one_line_and_the_server_exits_at_once(
    outcomes: dict[str, tuple[Case, Outcome]], name: str
) -> None:
    if name not in outcomes:
        pytest.skip("a CUDA device is present: --device cuda starts")
    case, outcome = outcomes[name]
    text = "\n".join(outcome.lines)
    errors = [line for line in outcome.lines if not LOG_BELOW_ERROR.match(line)]
    assert outcome.code == 1, text
    assert "Traceback" not in text
    assert len(errors) == 1, text
    assert errors[0].startswith(ERROR), text
    assert errors[0].removeprefix(ERROR).startswith(case.said), text
    assert outcome.error_at is not None
    assert outcome.exited_at - outcome.error_at < EXIT_AFTER_ERROR_S
    started = any("Started server process" in line for line in outcome.lines)
    assert started != case.before_any_process, text


def test_the_traceback_shows_at_debug_level(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "poolserve", "serve", str(tmp_path / "gone")]
    command += ["--port", "0", "--log-level", "debug"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "ModelLoadError" in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"{ERROR}model {str(tmp_path / 'gone')!r}: no such folder"
    )
