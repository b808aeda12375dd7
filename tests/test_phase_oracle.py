"""tools/phase_oracle.py: the switching oracle over the fixed partitions, in hindsight and across seeds (the
sweep runs minutes: it lives in tools/; here its arithmetic and a few steps of it)."""

from __future__ import annotations

import json
from pathlib import Path

import phase_oracle
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAIR = ["jobs/sim/hilo-bench.workload.yaml", "jobs/sim/cpu.cluster.yaml"]


def run(system: str, *segments: tuple[int, float], seed: int = 0) -> dict:
    tokens = sum(t for t, _ in segments)
    seconds = sum(s for _, s in segments)
    return {"system": system, "seed": seed, "goodput_tok_s": tokens / seconds,
            "segments": [{"steps": [i, i + 1], "eval": False, "tokens": t, "seconds": s}
                         for i, (t, s) in enumerate(segments)]}


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


def test_picks_made_on_one_seed_are_scored_with_the_other_seeds_runs() -> None:
    # Seed 0 picks a then b (best fixed b); on seed 1 the phases are the other way round: a 60 then 100, b 90, 90.
    runs = [run("a", (100, 1.0), (50, 1.0)), run("b", (80, 1.0), (80, 1.0)),
            run("a", (60, 1.0), (100, 1.0), seed=1), run("b", (90, 1.0), (90, 1.0), seed=1)]
    out = {(o["pick_seed"], o["score_seed"]): o for o in phase_oracle.pairs(runs, [0, 1])}
    assert [k for k in out] == [(0, 0), (0, 1), (1, 1), (1, 0)]
    assert out[0, 0]["hindsight"] and not out[0, 1]["hindsight"]
    assert out[0, 0]["oracle_over_best_fixed"] == pytest.approx(2.0 / 1.8, abs=1e-4)
    # Seed 0's picks (a, b) on seed 1: b's 90 + 90 tokens at a's 60 then b's 90 tok/s, 1.5 + 1.0 s against 2.0 s.
    assert out[0, 1]["best_fixed"] == "b" and out[0, 1]["oracle_over_best_fixed"] == pytest.approx(0.8, abs=1e-4)
    # Seed 1 picks b then a: in hindsight 1.0 + 0.9 s; on seed 0, 80/80 + 80/50 = 2.6 s.
    assert out[1, 1]["oracle_over_best_fixed"] == pytest.approx(2.0 / 1.9, abs=1e-4)
    assert out[1, 0]["oracle_over_best_fixed"] == pytest.approx(2.0 / 2.6, abs=1e-4)
    assert out[0, 1]["switches"] == 1 and "segments" not in out[0, 1]
    s = phase_oracle.summary(list(out.values()))
    assert s["hindsight_oracle_over_best_fixed_mean"] == pytest.approx((2 / 1.8 + 2 / 1.9) / 2, abs=1e-4)
    assert s["cross_seed_oracle_over_best_fixed_mean"] == pytest.approx((0.8 + 2 / 2.6) / 2, abs=1e-4)
    assert s["cross_seed_oracle_over_best_fixed_min"] == pytest.approx(2 / 2.6, abs=1e-4)
    assert s["cross_seed_pairs"] == 2


def test_the_best_fixed_split_is_chosen_on_the_pick_seed_and_the_score_seeds_own_is_named() -> None:
    # Seed 0: best fixed b, picks a then b. Seed 1: a is best (100, 100), b 90, 90.
    runs = [run("a", (100, 1.0), (50, 1.0)), run("b", (80, 1.0), (80, 1.0)),
            run("a", (100, 1.0), (100, 1.0), seed=1), run("b", (90, 1.0), (90, 1.0), seed=1)]
    out = phase_oracle.score([r for r in runs if r["seed"] == 1], *phase_oracle.pick(runs[:2]))
    # b's 90 + 90 tokens at 100 then 90 tok/s: 1.9 s against b's 2.0 s, but 180 / 1.9 tok/s against a's 100.
    assert out["best_fixed"] == "b" and out["oracle_over_best_fixed"] == pytest.approx(2.0 / 1.9, abs=1e-4)
    assert out["score_seed_best_fixed"] == "a"
    assert out["oracle_over_score_seed_best_fixed"] == pytest.approx(180 / 1.9 / 100, abs=1e-4)


def test_evaluation_steps_are_cut_out_as_segments_of_their_own() -> None:
    assert phase_oracle.eval_steps(20, 200, 100) == [0, 20, 40, 60, 80]
    assert phase_oracle.eval_steps(0, 200, 100) == [] and phase_oracle.eval_steps(20, 0, 100) == []
    points = phase_oracle.cut_points(100, list(range(10, 100, 10)), [0, 20, 40, 60, 80])
    assert points == [1, 10, 20, 21, 30, 40, 41, 50, 60, 61, 70, 80, 81, 90]
    assert phase_oracle.cut_points(6, [], [0, 5]) == [1, 5]  # the last step: a cut before it only
    # Six steps of 10 s each, the evaluation step 3 takes 25 s.
    ends = [10.0, 20.0, 30.0, 55.0, 65.0, 75.0]
    rows = [{"version": i, "end_s": e, "consumed_tokens": 100} for i, e in enumerate(ends)]
    segs = phase_oracle.segments(rows, phase_oracle.cut_points(6, [], [0, 3]), [0, 3])
    assert [s["steps"] for s in segs] == [[0, 1], [1, 3], [3, 4], [4, 6]]
    assert [s["eval"] for s in segs] == [True, False, True, False]
    assert [s["seconds"] for s in segs] == [10.0, 20.0, 25.0, 20.0]
    assert [s["tokens"] for s in segs] == [100, 200, 100, 200]


def test_a_few_steps_of_the_sweep_print_every_seed_pair_and_the_summary(capsys, tmp_path: Path) -> None:
    # hilo-bench evaluates never: a copy evaluating every 3 steps (steps 0 and 3 of 6).
    text = (ROOT / PAIR[0]).read_text().replace("eval_every_steps: 0 ", "eval_every_steps: 3 ")
    assert "eval_every_steps: 3 " in text
    workload = tmp_path / "hilo-eval.workload.yaml"
    workload.write_text(text)
    phase_oracle.main([str(workload), PAIR[1], "--cuts", "", "--cut-at-evals", "--seeds", "0-1",
                       "--steps", "6", "--jobs", "1", "--system", "tiderl"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(o["pick_seed"], o["score_seed"]) for o in lines[:-1]] == [(0, 0), (0, 1), (1, 1), (1, 0)]
    hind = lines[0]
    assert [s["steps"] for s in hind["segments"]] == [[0, 1], [1, 3], [3, 4], [4, 6]]
    assert [s["eval"] for s in hind["segments"]] == [True, False, True, False]
    assert hind["oracle_over_best_fixed"] >= 1.0
    last = lines[-1]
    assert last["eval_steps"] == [0, 3] and last["segment_bounds"] == [1, 3, 4] and last["cross_seed_pairs"] == 2
    assert last["hindsight_oracle_over_best_fixed_mean"] == pytest.approx(
        (lines[0]["oracle_over_best_fixed"] + lines[2]["oracle_over_best_fixed"]) / 2, abs=1e-4)
    assert last["cross_seed_oracle_over_best_fixed_mean"] == pytest.approx(
        (lines[1]["oracle_over_best_fixed"] + lines[3]["oracle_over_best_fixed"]) / 2, abs=1e-4)
    mine = last["against"]
    assert mine["system"].startswith("tiderl@") and [r["seed"] for r in mine["per_seed"]] == [0, 1]
    assert all(r["over_cross_seed_oracle"] > 0 and r["eval_over_best_fixed"] > 0 for r in mine["per_seed"])


def test_a_system_is_scored_against_the_cross_seed_oracle_and_the_best_evaluation_partition() -> None:
    def evaluating(system: str, seed: int, *segments: tuple[int, float, bool]) -> dict:
        return {"system": system, "seed": seed, "segments": [
            {"steps": [i, i + 1], "eval": e, "tokens": t, "seconds": sec} for i, (t, sec, e) in enumerate(segments)]}

    # Seed 1: partition a evaluates at 50 tok/s, b at 80; the system at 60 (0.75 of b), 240 tokens in 2.5 s.
    runs = [evaluating("a", 1, (100, 2.0, True), (100, 1.0, False)),
            evaluating("b", 1, (80, 1.0, True), (90, 1.0, False))]
    objects = [{"hindsight": False, "score_seed": 1, "oracle_tok_s": 100},
               {"hindsight": False, "score_seed": 1, "oracle_tok_s": 80},
               {"hindsight": True, "score_seed": 1, "oracle_tok_s": 1000}]  # hindsight: not counted
    out = phase_oracle.against([evaluating("sys", 1, (60, 1.0, True), (180, 1.5, False))], runs, objects)
    row = out["per_seed"][0]
    assert row["tok_s"] == 96 and row["over_cross_seed_oracle"] == pytest.approx(96 / 90, abs=1e-4)
    assert row["eval_best_fixed"] == "b" and row["eval_over_best_fixed"] == pytest.approx(0.75)
    assert out["eval_over_best_fixed_min"] == pytest.approx(0.75)


@pytest.mark.parametrize("cuts", ["0", "6", "x"])
def test_cuts_outside_the_run_are_refused_by_name(cuts: str) -> None:
    with pytest.raises(SystemExit, match="cut"):
        phase_oracle.main([*PAIR, "--cuts", cuts, "--steps", "6"])


def test_cutting_at_evaluations_of_a_workload_without_any_is_refused() -> None:
    with pytest.raises(SystemExit, match="no evaluation"):
        phase_oracle.main([*PAIR, "--cuts", "3", "--cut-at-evals", "--steps", "6"])
