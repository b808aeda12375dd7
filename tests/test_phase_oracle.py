"""tools/phase_oracle.py: the switching oracle over the fixed partitions (the sweep runs minutes: it lives in
tools/; here its arithmetic and a few steps of it)."""

from __future__ import annotations

import json

import phase_oracle
import pytest


def run(system: str, *segments: tuple[int, float]) -> dict:
    tokens = sum(t for t, _ in segments)
    seconds = sum(s for _, s in segments)
    return {"system": system, "seed": 0, "goodput_tok_s": tokens / seconds,
            "segments": [{"tokens": t, "seconds": s} for t, s in segments]}


def test_the_oracle_takes_each_segments_fastest_partition_for_the_best_fixed_ones_tokens() -> None:
    # a: 100 tok/s then 50; b: 80 then 80. Best fixed: b (160 tokens in 2 s against a's 150 in 2 s).
    a = run("a", (100, 1.0), (50, 1.0))
    b = run("b", (80, 1.0), (80, 1.0))
    out = phase_oracle.oracle([a, b])
    assert out["best_fixed"] == "b" and out["best_fixed_tok_s"] == 80
    assert [s["system"] for s in out["segments"]] == ["a", "b"]
    # b's 80 + 80 tokens at 100 then 80 tok/s: 0.8 + 1.0 s against 2.0 s.
    assert out["oracle_over_best_fixed"] == pytest.approx(2.0 / 1.8, abs=1e-4)
    # One partition best in every segment: the oracle is the best fixed split.
    assert phase_oracle.oracle([b, run("c", (10, 1.0), (10, 1.0))])["oracle_over_best_fixed"] == 1.0


def test_a_few_steps_of_the_sweep_print_one_line_per_seed_and_the_mean(capsys) -> None:
    phase_oracle.main(["jobs/sim/hilo-bench.workload.yaml", "jobs/sim/cpu.cluster.yaml", "--cuts", "3",
                       "--seeds", "0", "--steps", "6", "--jobs", "1"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines[0]["seed"] == 0 and len(lines[0]["segments"]) == 2
    assert lines[0]["oracle_over_best_fixed"] >= 1.0
    assert lines[-1]["oracle_over_best_fixed_mean"] == lines[0]["oracle_over_best_fixed"]


@pytest.mark.parametrize("cuts", ["0", "6", "x"])
def test_cuts_outside_the_run_are_refused_by_name(cuts: str) -> None:
    with pytest.raises(SystemExit, match="cut"):
        phase_oracle.main(["jobs/sim/hilo-bench.workload.yaml", "jobs/sim/cpu.cluster.yaml", "--cuts", cuts,
                           "--steps", "6"])
