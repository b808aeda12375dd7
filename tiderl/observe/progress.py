"""One live progress line for a long operation a person waits for (model init, checks, runs, reports).

On a terminal the line is redrawn in place (`\\r`) at most every `redraw_s`;
written to a file or a pipe, a new line appears when the step changes or
every `log_every_s`, so a log holds a readable history rather than thousands
of carriage returns; with `quiet_s`, not before the operation has run that
long (a job of 2 s leaves no lines in a log). `close` writes the final line
with the total time (not for a quiet operation that succeeded).

    with Progress("report", total=7, unit="figures") as p:
        for name in names:
            p.step(f"drawing {name}")
            draw(name)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


class Progress:
    def __init__(self, label: str, *, total: int | None = None, unit: str = "", out: TextIO | None = None,
                 redraw_s: float = 0.2, log_every_s: float = 10.0, quiet_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label = label
        self.total = total
        self.unit = unit
        self.out = out if out is not None else sys.stderr
        self.is_tty = self.out.isatty()
        self.redraw_s = redraw_s
        self.log_every_s = log_every_s
        self.quiet_s = quiet_s
        self._logged = False  # a line written to a file or pipe
        self.clock = clock
        self.started = clock()
        self.done = 0
        self.note = ""
        self._last_write = float("-inf")
        self._last_note: str | None = None
        self._width = 0
        self._in_step = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close("failed" if exc_type is not None else "done")

    def step(self, note: str = "") -> None:
        """Start the next step (the previous one is done)."""
        if self._in_step:
            self.done += 1
        self._in_step = True
        self.update(note)

    def update(self, note: str | None = None, *, done: int | None = None) -> None:
        """Report where the operation stands now (also between steps, e.g. from a polling loop)."""
        if done is not None:
            self.done = done
        if note is not None:
            self.note = note
        now = self.clock()
        if self.is_tty:
            if now - self._last_write >= self.redraw_s:
                self._redraw(self.line(now))
                self._last_write = now
        elif now - self.started < self.quiet_s:
            pass  # too soon to say anything in a log; the step's line comes once it has run quiet_s
        elif self.note != self._last_note or now - self._last_write >= self.log_every_s or not self._logged:
            print(self.line(now), file=self.out, flush=True)
            self._last_write, self._logged = now, True
        self._last_note = self.note

    def close(self, result: str = "done") -> None:
        if self.total is not None and result == "done":
            self.done = self.total
        line = f"{self.label}: {result} in {_secs(self.clock() - self.started)}"
        if self.total is not None:
            line += f" ({self.done}/{self.total}{' ' + self.unit if self.unit else ''})"
        if self.is_tty:
            self._redraw(line)
            print(file=self.out, flush=True)
        elif self._logged or result != "done" or self.clock() - self.started >= self.quiet_s:
            print(line, file=self.out, flush=True)

    def line(self, now: float) -> str:
        elapsed = now - self.started
        parts: list[str] = []
        if self.total is not None:
            parts.append(f"{min(self.done, self.total)}/{self.total}{' ' + self.unit if self.unit else ''}")
        parts.append(_secs(elapsed))
        if self.total and 0 < self.done < self.total:
            parts.append(f"eta {_secs(elapsed / self.done * (self.total - self.done))}")
        if self.note:
            parts.append(self.note)
        return f"{self.label}: " + "  ".join(parts)

    def _redraw(self, line: str) -> None:
        pad = max(0, self._width - len(line))
        print("\r" + line + " " * pad, end="", file=self.out, flush=True)
        self._width = len(line)


def _secs(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
