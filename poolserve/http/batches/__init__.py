"""OpenAI's Batch API (`--batch-dir`): files and batches kept on disk, each batch's lines answered
by this server's own app below interactive traffic.

A batch line reaches the app as an HTTP request of this process whose ASGI scope carries
`BATCH_LINE` (the owner's API key name): a client cannot set a scope extension, so only the
runner's requests have it. The edge then skips the key check, the rate limits and the request
accounting (the line's owner, its routes and models are still checked), and the pipeline
submits the line's prompts at `BATCH_PRIORITY`: the planner's background work, which runs only
in steps without interactive prompts, each step small.
"""

from __future__ import annotations

from poolserve.config.settings import ServerSettings
from poolserve.types.limits import BACKGROUND_PRIORITY

BATCH_LINE = "poolserve.batch_line"
# The planner's background work: after every interactive prompt, never in a step with one, in
# small steps (poolserve/engine/sched/planner.py).
BATCH_PRIORITY = BACKGROUND_PRIORITY
UPLOAD_PATH = "/v1/files"
MULTIPART_ROOM = 64 * 1024  # an upload's bytes beyond its file (headers, fields, boundaries)


def upload_limit(settings: ServerSettings) -> int | None:
    """The body limit of `POST /v1/files` (None: no Batch API, so the path has no exception)."""
    return None if settings.batch_dir is None else settings.max_batch_file_bytes + MULTIPART_ROOM
