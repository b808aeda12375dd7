"""tools/bench_ctb.py's arguments (the benchmark itself runs vLLM for minutes: it lives in tools/)."""

from __future__ import annotations

import argparse

import bench_ctb
import pytest


def test_overcommit_factors_parse_and_name_their_runs() -> None:
    assert bench_ctb._factors("2,2.75, 4") == (2.0, 2.75, 4.0)
    assert [bench_ctb.run_name(f) for f in (2.0, 2.75, 16.0)] == ["ctb_x2", "ctb_x2.75", "ctb_x16"]


@pytest.mark.parametrize("text", ["", "0.5", "2,x", ","])
def test_bad_overcommit_factors_are_refused_by_name(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="--overcommit"):
        bench_ctb._factors(text)
