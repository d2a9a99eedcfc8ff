"""Where `poolserve run-batch` writes its answers: stdout, or a file that appears whole."""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import tempfile
from typing import BinaryIO


class JobError(Exception):
    """What stops the whole job (exit 1): unreadable input, unwritable output, no model."""


class Output:
    """Where answers go: stdout, or a temporary file beside the output, renamed at the end."""

    def __init__(self, name: str, overwrite: bool = False) -> None:
        """Open the output; one that can't be written, or a file already there (unless
        `overwrite`), is refused (JobError) before any work."""
        self.name = name
        self.path: str | None = None if name == "-" else os.path.abspath(name)
        self.temporary: str | None = None
        if self.path is None:
            self.stream: BinaryIO = sys.stdout.buffer
            return
        if not overwrite and os.path.isfile(self.path):  # `poolserve embed`'s words
            raise JobError(
                f"{name} already exists: nothing is overwritten (pass --overwrite to replace it)"
            )
        try:
            if os.path.isdir(self.path):
                raise IsADirectoryError(errno.EISDIR, "Is a directory")
            folder, base = os.path.split(self.path)
            handle, self.temporary = tempfile.mkstemp(dir=folder, prefix=f".{base}.", suffix=".tmp")
            self.stream = os.fdopen(handle, "wb")
            os.fchmod(handle, 0o666 & ~_umask())  # the mode open() gives, not mkstemp's 0600
        except OSError as exc:
            self.discard()
            raise self._error(exc) from None

    def commit(self) -> None:
        """Everything written: the output appears whole (the rename is atomic)."""
        try:
            self.stream.flush()
            if self.temporary is not None and self.path is not None:
                os.fsync(self.stream.fileno())
                self.stream.close()
                os.replace(self.temporary, self.path)
                self.temporary = None
        except OSError as exc:
            raise self._error(exc) from None

    def discard(self) -> None:
        """A failed job: the temporary file is removed (stdout keeps what was written)."""
        if self.temporary is None:
            return
        if hasattr(self, "stream"):
            self.stream.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.temporary)
        self.temporary = None

    def write(self, data: bytes) -> None:
        """Answers appended (in a worker thread: a pipe or a full disk may block)."""
        try:
            self.stream.write(data)
        except OSError as exc:
            raise self._error(exc) from None

    def _error(self, exc: OSError) -> JobError:
        return JobError(f"cannot write the output {self.name}: {exc.strerror or exc}")


def _umask() -> int:
    """The process's umask (read by setting it: done once, before any thread writes files)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask
