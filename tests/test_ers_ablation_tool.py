"""tools/ers_ablation.py: a rule's verdict from per-seed ratios, the overall call, and one short real run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import ers_ablation  # noqa: E402


def test_a_rule_pays_costs_or_stays_within_the_seeds_spread() -> None:
    pays = ers_ablation.verdict([110.0, 112.0, 108.0], [100.0, 100.0, 100.0])
    assert pays["verdict"] == "pays" and pays["mean_ratio"] == pytest.approx(1.1)
    assert ers_ablation.verdict([90.0, 91.0, 89.0], [100.0, 100.0, 100.0])["verdict"] == "costs"
    noisy = ers_ablation.verdict([120.0, 85.0, 101.0], [100.0, 100.0, 100.0])  # 2% on average, +-20% a seed
    assert noisy["verdict"] == "within spread"
    assert ers_ablation.verdict([110.0], [100.0])["verdict"] == "within spread"  # one seed has no spread
    assert ers_ablation.verdict([1.0], [0.0])["verdict"] == "no goodput"


def test_a_rule_earns_its_keep_where_it_pays_somewhere_and_costs_nowhere() -> None:
    per_pair = {"a": {"x": {"verdict": "pays"}, "y": {"verdict": "pays"}, "z": {"verdict": "within spread"}},
                "b": {"x": {"verdict": "within spread"}, "y": {"verdict": "costs"}, "z": {"verdict": "within spread"}}}
    got = ers_ablation.overall(per_pair, ["x", "y", "z"])
    assert got["x"] == {"pays_on": ["a"], "costs_on": [], "earns_keep": True}
    assert got["y"]["earns_keep"] is False and got["y"]["costs_on"] == ["b"]
    assert got["z"]["earns_keep"] is False


def test_the_tool_ablates_on_a_real_pair() -> None:
    out = subprocess.run([sys.executable, "tools/ers_ablation.py", "--pairs", "text-agentic:h100x8", "--rules",
                          "walk,evaluation_actors", "--seeds", "0-1", "--steps", "4", "--jobs", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    assert set(doc["mean_tok_s"]["text-agentic:h100x8"]) == {"tiderl", "tiderl~walk", "tiderl~evaluation_actors"}
    assert set(doc["overall"]) == {"walk", "evaluation_actors"}
    assert all(len(v["ratios"]) == 2 for v in doc["per_pair"]["text-agentic:h100x8"].values())
    assert "text-agentic:h100x8 done" in out.stderr
    bad = subprocess.run([sys.executable, "tools/ers_ablation.py", "--rules", "nope"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and "no such ERS rule" in bad.stderr
    bad = subprocess.run([sys.executable, "tools/ers_ablation.py", "--starts", "1.5"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and "--starts" in bad.stderr


def test_the_tool_ablates_from_other_starts() -> None:
    out = subprocess.run([sys.executable, "tools/ers_ablation.py", "--pairs", "hilo-bench:cpu", "--rules", "walk",
                          "--starts", "0.34,0.67", "--seeds", "0", "--steps", "3", "--jobs", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert set(json.loads(out.stdout)["per_pair"]) == {"hilo-bench:cpu@0.34", "hilo-bench:cpu@0.67"}
