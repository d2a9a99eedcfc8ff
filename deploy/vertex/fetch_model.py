"""Copy the model Vertex AI names in AIP_STORAGE_URI (gs://bucket/folder) into a local folder.

Vertex AI hands a container the model uploaded with `--artifact-uri` as a Cloud Storage URI;
`deploy/vertex/serve` calls this before the server starts, and the server loads the folder.
Usage: python3 fetch_model.py gs://bucket/folder DESTINATION
"""

from __future__ import annotations

import sys
from pathlib import Path, PurePosixPath
from typing import Any

SCHEME = "gs://"


def split_uri(uri: str) -> tuple[str, str]:
    """(bucket, prefix ending in "/" or empty) of a gs:// URI; ValueError for anything else."""
    if not uri.startswith(SCHEME) or len(uri) == len(SCHEME):
        raise ValueError(f"AIP_STORAGE_URI must be gs://bucket[/folder], got {uri!r}")
    bucket, _, prefix = uri[len(SCHEME) :].partition("/")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


def local_path(destination: Path, prefix: str, name: str) -> Path | None:
    """Where object `name` goes under `destination` (None: a folder marker); a name that would
    leave the destination (`..`, an absolute part) is refused."""
    relative = PurePosixPath(name[len(prefix) :])
    if not relative.parts:
        return None
    if relative.is_absolute() or ".." in relative.parts:
        raise ValueError(f"refusing object {name!r}: it would be written outside {destination}")
    if name.endswith("/"):
        return None
    return destination.joinpath(*relative.parts)


def fetch(uri: str, destination: Path, client: Any) -> int:
    """Download every object under the URI's folder; the number of files written."""
    bucket, prefix = split_uri(uri)
    count = 0
    for blob in client.list_blobs(bucket, prefix=prefix):
        target = local_path(destination, prefix, blob.name)
        if target is None:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        blob.download_to_filename(str(target))
        count += 1
    if count == 0:
        raise ValueError(f"no model files under {uri}")
    return count


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: fetch_model.py gs://bucket/folder DESTINATION", file=sys.stderr)
        return 2
    from google.cloud import storage  # the Vertex image installs it (deploy/vertex/Dockerfile)

    destination = Path(argv[1])
    destination.mkdir(parents=True, exist_ok=True)
    try:
        count = fetch(argv[0], destination, storage.Client())
    except ValueError as exc:
        print(f"cannot fetch the model: {exc}", file=sys.stderr)
        return 1
    print(f"fetched {count} files from {argv[0]} into {destination}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
