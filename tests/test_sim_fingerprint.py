"""tools/sim_fingerprint.py: a run's goodput and per-step digest, equal for equal runs and apart for a changed
decision (a few steps of the simulator)."""

from __future__ import annotations

import json

import sim_fingerprint


def test_equal_runs_give_equal_digests_and_an_ablated_rule_that_acts_does_not(capsys) -> None:
    for _ in range(2):
        sim_fingerprint.main(["--systems", "tiderl,tiderl~slot_bound", "--pairs", "bench-latency:cpu",
                              "--seeds", "0", "--steps", "12", "--jobs", "1"])
    first, second = (json.loads(line)["runs"] for line in capsys.readouterr().out.splitlines())
    assert first == second  # the simulator is deterministic: a refactor must keep every digest
    kept, ablated = first["bench-latency:cpu|tiderl"][0], first["bench-latency:cpu|tiderl~slot_bound"][0]
    assert kept[0] > 0 and len(kept[1]) == 12
    assert kept[1] != ablated[1]  # the slot bound decides within 12 steps here: the digest sees it
