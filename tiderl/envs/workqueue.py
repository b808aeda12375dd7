"""Blocking environment calls on a bounded pool of threads, for the env server (`WorkQueue`).

No HTTP here: the caller passes, with each call, whether its client still wants it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class CallDropped(Exception):
    """A queued environment call whose client left before a worker thread was free."""


class WorkQueue:
    """Blocking environment calls on `num_workers` threads, with at most `max_waiting` calls
    waiting for one.

    Calls wait here, on the event loop, not in the executor's own unbounded queue, so that
    - a call beyond `max_waiting` is refused up front (`has_room`), and
    - a waiting call whose client has gone (`is_wanted()` false) is dropped (`CallDropped`)
      instead of running for nobody: when a thread comes free for it, and whenever
      `has_room` counts the queue (so abandoned calls do not keep others out)."""

    def __init__(self, *, num_workers: int, max_waiting: int) -> None:
        self.num_workers = num_workers
        self.max_waiting = max_waiting
        self.executor = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="env")
        self.num_running = 0  # threads given to calls (a thread passes from call to call in `_hand_on`)
        self._waiting: deque[tuple[asyncio.Future[None], Callable[[], bool] | None]] = deque()
        self.num_dropped = 0

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_room(self) -> bool:
        if self.num_running < self.num_workers:
            return True
        self._drop_unwanted()
        return len(self._waiting) < self.max_waiting

    async def run(self, fn: Callable[..., Any], *args: Any, is_wanted: Callable[[], bool] | None = None) -> Any:
        if self.num_running < self.num_workers:
            self.num_running += 1
        else:
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            entry = (turn, is_wanted)
            self._waiting.append(entry)
            try:
                await turn  # CallDropped if dropped
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled() and turn.exception() is None:
                    self._hand_on()  # it was given a thread: pass it on
                elif entry in self._waiting:
                    self._waiting.remove(entry)
                raise
        loop = asyncio.get_running_loop()

        def done(_: Future[Any]) -> None:  # in the worker thread: only now is the thread free
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
                loop.call_soon_threadsafe(self._hand_on)

        try:
            future = self.executor.submit(fn, *args)
        except BaseException:
            self._hand_on()
            raise
        future.add_done_callback(done)
        return await asyncio.wrap_future(future)

    def _hand_on(self) -> None:
        """A thread is free: give it to the next waiting call still wanted, else put it back."""
        while self._waiting:
            turn, is_wanted = self._waiting.popleft()
            if turn.done():  # its request was cancelled
                continue
            if is_wanted is not None and not is_wanted():
                self._drop(turn)
                continue
            turn.set_result(None)
            return
        self.num_running -= 1

    def _drop_unwanted(self) -> None:
        if all(is_wanted is None or is_wanted() for _, is_wanted in self._waiting):
            return
        keep: deque[tuple[asyncio.Future[None], Callable[[], bool] | None]] = deque()
        for turn, is_wanted in self._waiting:
            if is_wanted is None or is_wanted():
                keep.append((turn, is_wanted))
            elif not turn.done():
                self._drop(turn)
        self._waiting = keep

    def _drop(self, turn: asyncio.Future[None]) -> None:
        self.num_dropped += 1
        turn.set_exception(CallDropped("its client disconnected while it waited for a worker thread"))

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
