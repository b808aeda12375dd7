"""The env server's loggers, and the filters that keep them readable when a client
floods or misbehaves.

- `RepeatFilter`: one record of a kind per `LOG_REPEAT_WINDOW_S`, with a count of the
  repeats; it limits the server's log from WARNING up, and its `conn`, `http` and
  `loop` logs from INFO up.
- `QuietClientErrors`: a client's mistake or hang-up, which aiohttp logs as an error
  with a traceback, becomes one quiet line.
- `log_loop_error`: the event loop's exception handler while a server runs.

Importing this module installs the filters on the loggers below.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

log = logging.getLogger("tiderl.envs.server")
conn_log = logging.getLogger("tiderl.envs.server.conn")  # refusals, timeouts, clients that hang up
http_log = logging.getLogger("tiderl.envs.server.http")  # aiohttp's own request handling
loop_log = logging.getLogger("tiderl.envs.server.loop")  # event loop errors, e.g. accept() out of files

LOG_REPEAT_WINDOW_S = 10.0


class RepeatFilter(logging.Filter):
    """Passes one record of a kind per `window_s` and counts the others; the next record of
    that kind to pass says how many were suppressed. A kind is the logger, the level, the
    message template and the exception type, so a flood of one error costs a line per window.
    Records below `min_level` always pass."""

    def __init__(self, window_s: float = LOG_REPEAT_WINDOW_S, min_level: int = logging.DEBUG,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window_s = window_s
        self.min_level = min_level
        self.clock = clock
        self._passed: dict[tuple[str, int, str, str], tuple[float, int]] = {}  # kind -> (passed at, suppressed)
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.min_level:
            return True
        exc_type = record.exc_info[0] if record.exc_info else None
        kind = (record.name, record.levelno, str(record.msg), exc_type.__name__ if exc_type else "")
        now = self.clock()
        with self._lock:
            last = self._passed.get(kind)
            if last is not None and now - last[0] < self.window_s:
                self._passed[kind] = (last[0], last[1] + 1)
                return False
            self._passed[kind] = (now, 0)
            if len(self._passed) > 4096:  # forget kinds that are quiet and have nothing to report
                self._passed = {k: v for k, v in self._passed.items() if v[1] or now - v[0] < self.window_s}
        if last is not None and last[1]:
            record.msg = f"{record.msg} ({last[1]} similar suppressed in the last {now - last[0]:.0f} s)"
        return True


class QuietClientErrors(logging.Filter):
    """aiohttp logs an unparseable request (a body that is not the gzip it says included: aiohttp drains it
    again after the handler's 400), and a client that hangs up mid-answer, as an error with a traceback;
    both are the client's doing: one INFO line, or a DEBUG one."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, RequestPayloadError) and isinstance(exc.__cause__, HttpProcessingError):
            exc = exc.__cause__
        if isinstance(exc, (HttpProcessingError, ConnectionError)):
            peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            if isinstance(exc, HttpProcessingError):
                record.msg, record.levelno, what = "bad HTTP request from %s: %s", logging.INFO, exc.message
            else:
                record.msg, record.levelno, what = "client %s hung up: %s", logging.DEBUG, str(exc)
            record.args = (peer, " ".join(what.split()) or type(exc).__name__)
            record.levelname = logging.getLevelName(record.levelno)
            record.exc_info = record.exc_text = None
        return True


log.addFilter(RepeatFilter(min_level=logging.WARNING))
http_log.addFilter(QuietClientErrors())
for _logger in (conn_log, http_log, loop_log):
    _logger.addFilter(RepeatFilter(min_level=logging.INFO))


def log_loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The event loop's exception handler while a server runs: through `loop_log`, so repeats
    are counted rather than written; an OSError (EMFILE on accept) needs no traceback."""
    exc = context.get("exception")
    message = str(context.get("message") or "event loop error").replace("%", "%%")
    if exc is None:
        loop_log.error(message)
    else:
        loop_log.error(message + ": %s: %s", type(exc).__name__, exc,
                       exc_info=None if isinstance(exc, OSError) else exc)
