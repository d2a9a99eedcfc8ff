"""The one error a corpus job reports to its user: a clear line, never a traceback."""

from __future__ import annotations


class JobError(Exception):
    """Bad input, a refused rerun or an unusable option: one line on stderr, exit 1."""

    def __init__(self, message: str) -> None:
        # one line whatever the source (pyarrow's messages span several)
        super().__init__(" ".join(message.split()))


def row_name(position: int, row_id: object = None) -> str:
    """How messages name a row: its id, and its position in the input (from 1)."""
    if row_id is None:
        return f"row {position + 1}"
    return f"row id={row_id!r} (row {position + 1})"
