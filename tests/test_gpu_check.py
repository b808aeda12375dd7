"""tools/gpu_check.sh and tools/gpu_check.py, the one script a lent GPU machine runs: every stage of it
here on the CPU (tiny model, vLLM's CPU engine, the fsdp backend on a gloo group of one, fp32), a stage past
its time budget reported while the others run, and the vLLM plugins found where tiderl is not installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"


def _shell(out: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OUT=str(out), TIDERL_GPU_CHECK_PYTHON=sys.executable)
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def test_the_shell_script_parses_and_is_shellcheck_clean() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    shellcheck = shutil.which("shellcheck")
    if shellcheck:
        done = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout


def test_without_a_python_that_has_torch_the_script_says_so_in_its_json(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path), TIDERL_GPU_CHECK_PYTHON="/bin/false")
    done = subprocess.run(["bash", str(SCRIPT), "--device", "cpu"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["ok"] is False and "no Python with torch" in doc["error"]


def test_a_stage_past_its_budget_is_reported_with_the_process_killed(tmp_path: Path) -> None:
    done = _shell(tmp_path, "--size", "tiny", "--device", "cpu", "--processes", "environment",
                  "--budget", "environment=0.2", "--total-budget", "0", timeout=120)
    assert done.returncode == 1, done.stderr
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["finished"] and not doc["ok"] and doc["failed"] == ["environment", "memory"]
    env = doc["stages"]["environment"]
    assert "timed out" in env["error"] and "0 s" in env["error"]
    assert "using " + sys.executable in done.stderr  # which Python it chose, said on stderr


def test_the_vllm_plugins_are_found_where_tiderl_is_not_installed(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu_check_env import PLUGIN_GROUP, PLUGINS, ensure_vllm_plugins

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    assert ensure_vllm_plugins(tmp_path, force=True).startswith("added")
    site = tmp_path / "vllm-plugins"
    assert str(site) in sys.path and os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(site)
    # What importlib.metadata finds there (vLLM's plugin loader asks it in every process it starts).
    code = ("import json, sys\nfrom importlib import metadata\n"
            "print(json.dumps({e.name: e.value for d in metadata.distributions(path=[sys.argv[1]])"
            " for e in d.entry_points if e.group == sys.argv[2]}))")
    seen = json.loads(subprocess.run([sys.executable, "-c", code, str(site), PLUGIN_GROUP], capture_output=True,
                                     text=True, check=True).stdout)
    assert seen == PLUGINS


@pytest.mark.slow
@pytest.mark.vllm
def test_every_stage_runs_on_a_cpu_with_figures_and_no_error(tmp_path: Path) -> None:
    done = _shell(tmp_path, "--size", "tiny", "--device", "cpu", timeout=400)
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    errors = {name: (s.get("error"), s.get("traceback", s.get("log_tail", ""))[-1500:])
              for name, s in doc["stages"].items() if not s.get("ok")}
    assert done.returncode == 0 and doc["ok"] and doc["finished"], errors
    stages = doc["stages"]
    assert list(stages) == ["environment", "model", "fsdp_step", "vllm_engine", "logprob_agreement",
                            "weight_transfer", "memory"]
    for name, s in stages.items():
        assert s["error"] is None and isinstance(s["seconds"], float), name
        if name != "memory":
            assert s["memory"]["host_rss_peak_bytes"] > 0, name
    assert (tmp_path / "gpu_check.log").is_file()

    env = stages["environment"]
    assert env["device"] == "cpu" and env["torch"] and env["vllm"] and env["gloo_available"]
    model = stages["model"]
    assert model["parameters"] > 0 and model["vocab_size"] >= model["tokenizer_size"] > 256
    assert model["dtype"] == ["torch.bfloat16"] and model["bytes_on_disk"] > 0

    step = stages["fsdp_step"]
    assert step["backend"] == "fsdp" and step["process_group"] == "gloo" and step["world_size"] == 1
    assert step["step_s"] > 0 and step["tokens_per_s"] > 0 and step["tokens_per_step"] == 2 * 2 * 48
    assert len(step["steps_s"]) == 2 and step["grad_norm"] >= 0

    engine = stages["vllm_engine"]
    assert engine["start_s"] > 0 and engine["tokens_per_s"] > 0 and engine["generates_after_wake"]
    assert engine["requests"] <= engine["generated_tokens"] <= engine["requests"] * engine["new_tokens"]
    assert engine["sleep_supported"] is False  # vLLM has no sleep mode on a CPU

    agree = stages["logprob_agreement"]  # fp32 on both sides: the engine serves the trainer's model exactly
    assert 4 <= agree["engine_vs_trainer"]["tokens"] <= 4 * 8
    assert agree["max_abs"] < 1e-4 and agree["mean_abs"] <= agree["max_abs"]
    assert agree["trainer_vs_fp32"]["max_abs"] == 0.0

    transfer = stages["weight_transfer"]
    assert [v["version"] for v in transfer["versions"]] == [1, 2]
    for v in transfer["versions"]:
        assert v["received_version"] == v["version"] and v["engine_bytes"] == v["bytes"] > 0
        assert v["total_s"] > 0 and v["after_transfer"]["max_abs"] < 1e-4  # the engine serves the trained weights
        assert v["via"] == "shared_memory"  # the engine is on the server's host: it maps the buckets
    assert transfer["seconds_per_version"] > 0 and "shared-memory" in transfer["transport"]

    memory = stages["memory"]
    assert set(memory["per_stage"]) == set(stages) - {"memory"} and memory["host_rss_peak_bytes"] > 0
