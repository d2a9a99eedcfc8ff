"""What a corpus job shows while it runs: a tqdm bar on a terminal, one summary line at the end."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TextIO

from tqdm import tqdm


@dataclass(frozen=True)
class Totals:
    """Rows and prompt tokens embedded by this run, and the seconds it took."""

    rows: int
    tokens: int
    seconds: float

    def summary(self) -> str:
        """The final log line: rows, tokens, seconds and both rates."""
        seconds = max(self.seconds, 1e-9)
        return (
            f"embedded {self.rows} rows ({self.tokens} prompt tokens) in {self.seconds:.1f} s: "
            f"{self.rows / seconds:.1f} rows/s, {self.tokens / seconds:.0f} tokens/s"
        )


class Progress:
    """Rows done of the total (ETA from tqdm's rate), tokens per second; silent off a terminal."""

    def __init__(
        self,
        total: int | None,
        done: int,
        stream: TextIO | None = None,
        enabled: bool | None = None,
    ) -> None:
        stream = sys.stderr if stream is None else stream
        self._bar = tqdm(
            total=total,
            initial=done,
            unit="row",
            file=stream,
            disable=not self.shown(enabled, stream),
            dynamic_ncols=True,
            smoothing=0.05,
        )
        self._start = time.perf_counter()
        self.rows = 0
        self.tokens = 0

    @staticmethod
    def shown(enabled: bool | None, stream: TextIO | None = None) -> bool:
        """Whether a bar is drawn: as asked, else when the stream is a terminal."""
        if enabled is not None:
            return enabled
        return (sys.stderr if stream is None else stream).isatty()

    def advance(self, rows: int, tokens: int) -> None:
        """Rows (and their prompt tokens) written to the job's parts."""
        self.rows += rows
        self.tokens += tokens
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        self._bar.set_postfix_str(f"{self.tokens / elapsed:.0f} tokens/s", refresh=False)
        self._bar.update(rows)

    def close(self) -> Totals:
        """Close the bar; this run's totals."""
        self._bar.close()
        return Totals(self.rows, self.tokens, time.perf_counter() - self._start)
