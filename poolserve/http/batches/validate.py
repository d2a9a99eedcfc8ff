"""A batch's input file checked before any line runs (OpenAI's `validating`): every line one
request for the batch's endpoint, custom ids unique, within the server's bounds.

Read in bounded pieces (a line above the body limit is never held whole) in a worker thread;
custom ids are remembered by digest, so the memory held is a few dozen bytes per line whatever
the ids' lengths.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from poolserve.http.batches.lines import LineError, LineReader, parse_line, too_long
from poolserve.http.batches.store import LineFault
from poolserve.types.errors import clip

MOST_FAULTS = 100  # faults listed in the batch's `errors` (the first ones, in line order)
READ_LINES = 256


@dataclass(frozen=True)
class Checked:
    """What validation found: the request lines and the faults."""

    total: int
    faults: tuple[LineFault, ...]


def check_input(path: Path, endpoint: str, body_limit: int, most_requests: int) -> Checked:
    """Check every line of the file at `path` (FileNotFoundError when it is gone)."""
    faults: list[LineFault] = []
    seen: set[bytes] = set()
    total = 0
    with open(path, "rb") as stream:
        reader = LineReader(stream, body_limit)
        while lines := reader.read(READ_LINES, body_limit):
            for number, line in lines:
                total += 1
                if total > most_requests:
                    message = f"the file has more than {most_requests} requests"
                    faults.append(
                        LineFault("too_many_requests", message + " (--max-batch-requests)")
                    )
                    return Checked(total, tuple(faults[:MOST_FAULTS]))
                fault = _fault(number, line, endpoint, body_limit, seen)
                if fault is not None:
                    faults.append(fault)
                    if len(faults) == MOST_FAULTS:  # enough to fix the file by
                        return Checked(total, tuple(faults))
    if total == 0:
        faults.append(LineFault("empty_file", "the input file has no request lines"))
    return Checked(total, tuple(faults))


def _fault(
    number: int, line: bytes | None, endpoint: str, body_limit: int, seen: set[bytes]
) -> LineFault | None:
    """What is wrong with one line (None: nothing)."""
    if line is None:
        error = too_long(number, body_limit)
        return LineFault(error.code, error.message, number)
    try:
        request = parse_line(line, number)
    except LineError as exc:
        return LineFault(exc.code, exc.message, number, exc.param)
    if request.url != endpoint:
        message = f"line {number}: url {clip(request.url)!r} is not the batch's endpoint {endpoint}"
        return LineFault("mismatched_endpoint", message, number, "url")
    digest = hashlib.blake2b(request.custom_id.encode(), digest_size=16).digest()
    if digest in seen:
        message = f"line {number}: custom_id {clip(request.custom_id)!r} is used by an earlier line"
        return LineFault("duplicate_custom_id", message, number, "custom_id")
    seen.add(digest)
    return None
