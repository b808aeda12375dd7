"""Whole-or-nothing writes in the run directory wait for room on a full disk (tiderl.paths.when_room)."""

from __future__ import annotations

import errno

import pytest

from tiderl.paths import when_room


def failing(n: int, err: int = errno.ENOSPC):
    calls = []

    def fn() -> str:
        calls.append(1)
        if len(calls) <= n:
            raise OSError(err, "No space left on device", "/run/weights/.v3.tmp-x")
        return "done"

    return fn, calls


def test_a_write_is_run_again_while_the_disk_is_full():
    fn, calls = failing(3)
    slept = []
    assert when_room(fn, wait_s=10, what="weights v3", sleep=slept.append) == "done"
    assert len(calls) == 4 and slept == [1.0, 1.0, 1.0]


def test_past_the_wait_the_error_names_what_was_written():
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    fn, calls = failing(100, errno.EDQUOT)
    with pytest.raises(OSError, match="weights v3: the disk is still full after 5 s") as info:
        when_room(fn, wait_s=5, what="weights v3", sleep=sleep, clock=lambda: now[0])
    assert info.value.errno == errno.EDQUOT and len(calls) == 6


def test_other_errors_are_not_retried():
    fn, calls = failing(1, errno.EACCES)
    with pytest.raises(PermissionError):
        when_room(fn, wait_s=60, what="x", sleep=lambda s: None)
    assert len(calls) == 1
