"""The shared progress line (tiderl/observe/progress.py) that `tiderl report` shows: a fake clock, no sleeping."""

from __future__ import annotations

import io

from tiderl.observe.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_output_writes_a_line_per_step_and_a_heartbeat_line() -> None:
    out, clock = io.StringIO(), Clock()
    with Progress("report", total=4, unit="figures", out=out, log_every_s=10.0, clock=clock) as p:
        p.step("drawing goodput")
        clock.t += 2.0
        p.step("drawing reward")
        clock.t += 1.0
        p.update()  # same step, 1 s later: nothing new to log
        clock.t += 10.0
        p.update()  # same step, 10 s later: a line so a log shows it is alive
    lines = out.getvalue().splitlines()
    assert lines[0] == "report: 0/4 figures  0.0 s  drawing goodput"
    assert lines[1] == "report: 1/4 figures  2.0 s  eta 6.0 s  drawing reward"
    assert lines[2] == "report: 1/4 figures  13.0 s  eta 39.0 s  drawing reward"
    assert lines[3] == "report: done in 13.0 s (4/4 figures)"
    assert len(lines) == 4 and "\r" not in out.getvalue()


def test_terminal_output_redraws_one_line_in_place() -> None:
    out, clock = Tty(), Clock()
    p = Progress("init-model", out=out, clock=clock)
    p.update("training the tokenizer")
    clock.t += 1.0
    p.update("warm start")
    p.close()
    text = out.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n")
    assert text.split("\r")[-1].startswith("init-model: done in 1.0 s")
    # The shorter last line is padded so nothing of the longer one before stays visible.
    assert len(text.split("\r")[2]) >= len(text.split("\r")[1].rstrip())


def test_a_failure_is_reported_as_failed() -> None:
    out = io.StringIO()
    try:
        with Progress("bench", out=out, clock=Clock()):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert out.getvalue().splitlines()[-1] == "bench: failed in 0.0 s"
