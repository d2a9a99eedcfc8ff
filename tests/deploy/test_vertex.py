"""Vertex AI's image: its Dockerfile passes hadolint, its entry script shellcheck; a model given
as AIP_STORAGE_URI is copied object by object into the local folder the server then loads
(checked with a stand-in Cloud Storage client), and nothing is written outside that folder."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.deploy.tools import REPO_ROOT, require_tool, run_tool

pytestmark = pytest.mark.slow

FOLDER = REPO_ROOT / "deploy" / "vertex"


def _fetcher() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fetch_model", FOLDER / "fetch_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Blob:
    def __init__(self, name: str, data: bytes) -> None:
        self.name, self.data = name, data

    def download_to_filename(self, filename: str) -> None:
        Path(filename).write_bytes(self.data)


class Client:
    """Cloud Storage's list_blobs over a dict of object names."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects
        self.asked: list[tuple[str, str]] = []

    def list_blobs(self, bucket: str, prefix: str) -> list[Blob]:
        self.asked.append((bucket, prefix))
        return [Blob(n, d) for n, d in self.objects.items() if n.startswith(prefix)]


def test_hadolint_and_shellcheck_pass() -> None:
    for tool, path in (("hadolint", FOLDER / "Dockerfile"), ("shellcheck", FOLDER / "serve")):
        result = run_tool([require_tool(tool), str(path)])
        assert result.returncode == 0, result.describe()


def test_the_folder_is_copied_as_it_lies(tmp_path: Path) -> None:
    objects = {
        "models/minilm/": b"",  # the folder marker the console writes
        "models/minilm/config.json": b"{}",
        "models/minilm/1_Pooling/config.json": b'{"pooling_mode_mean_tokens": true}',
        "models/other/config.json": b"not this one",
    }
    client = Client(objects)
    count = _fetcher().fetch("gs://bucket/models/minilm/", tmp_path / "model", client)
    assert count == 2 and client.asked == [("bucket", "models/minilm/")]
    assert (tmp_path / "model" / "config.json").read_bytes() == b"{}"
    assert (tmp_path / "model" / "1_Pooling" / "config.json").is_file()
    assert not (tmp_path / "model" / "other").exists()


@pytest.mark.parametrize(
    "uri,objects,words",
    [
        ("s3://bucket/model", {}, "gs://"),
        ("gs://bucket/empty", {}, "no model files"),
        ("gs://bucket/m", {"m/../../escape": b"x"}, "outside"),
    ],
)
def test_refusals(tmp_path: Path, uri: str, objects: dict[str, bytes], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        _fetcher().fetch(uri, tmp_path / "model", Client(objects))
    assert not (tmp_path / "escape").exists()


def test_serve_fetches_then_starts_the_server(tmp_path: Path) -> None:
    """The entry script copies AIP_STORAGE_URI's model, then runs `poolserve serve` on it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "record"
    for name, line in (
        ("python3", 'echo "fetch $*" >> "$RECORD"'),
        ("poolserve", 'echo "serve $* model=$POOLSERVE_MODEL" >> "$RECORD"'),
    ):
        (bin_dir / name).write_text(f"#!/bin/sh\n{line}\n")
        (bin_dir / name).chmod(0o755)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("POOLSERVE_", "AIP_"))},
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "RECORD": str(record),
        "AIP_STORAGE_URI": "gs://bucket/minilm",
        "POOLSERVE_VERTEX_MODEL_DIR": str(tmp_path / "model"),
    }
    done = subprocess.run(
        [str(FOLDER / "serve"), "--dtype", "float32"], env=env, capture_output=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert record.read_text().splitlines() == [
        f"fetch {FOLDER / 'fetch_model.py'} gs://bucket/minilm {tmp_path / 'model'}",
        f"serve serve --dtype float32 model={tmp_path / 'model'}",
    ]


def test_fetch_model_usage(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(FOLDER / "fetch_model.py")], capture_output=True, text=True
    )
    assert done.returncode == 2 and "usage" in done.stderr
