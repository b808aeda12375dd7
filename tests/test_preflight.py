"""Pre-flight checks of a job's model and trainer (tiderl.models.preflight): each problem of a `model.path`
named with the key, the directory and what is wrong, by `tiderl config`, `tiderl submit --dry-run` and
`tiderl run` (and `--resume`) before anything is created. The model directories are small ones written
here (a tokenizer trained on the spot, a Qwen2 config, a stand-in safetensors file: nothing loads
weights); vLLM's registry is a stand-in except in the one `slow` test."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tiderl.config import ConfigError, JobConfig, load_job
from tiderl.models import preflight

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "jobs" / "quickstart.yaml"
VLLM_ARCHS = frozenset({"Qwen2ForCausalLM", "Qwen2VLForConditionalGeneration"})
REAL_VLLM_ARCHITECTURES = preflight.vllm_architectures

CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 512,
    "tie_word_embeddings": True, "torch_dtype": "float32",
}


@pytest.fixture(scope="module")
def good_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory vLLM and transformers would load as far as these checks look."""
    import numpy as np
    from safetensors.numpy import save_file

    from tiderl.models.tiny_model import train_tokenizer

    out = tmp_path_factory.mktemp("model")
    tokenizer = train_tokenizer(["guess 8", "higher", "lower", "correct, 3 turns"], vocab_size=300)
    tokenizer.save_pretrained(out)
    (out / "config.json").write_text(json.dumps({**CONFIG, "vocab_size": len(tokenizer)}))
    save_file({"model.embed_tokens.weight": np.zeros((len(tokenizer), 16), dtype=np.float32)},
              str(out / "model.safetensors"))
    return out


@pytest.fixture(autouse=True)
def vllm_registry(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """vLLM's architectures without importing vLLM (seconds); records each call's `vision`."""
    calls: list[bool] = []
    monkeypatch.setattr(preflight, "vllm_architectures", lambda vision: calls.append(vision) or VLLM_ARCHS)
    return calls


def job_with(model: Path | None, *sets: str) -> JobConfig:
    return load_job(JOB, [f"model.path={'null' if model is None else model}", *sets])


def copy_of(good_model: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(good_model, tmp_path / "model"))


def edit_config(model: Path, **changes: object) -> None:
    config = json.loads((model / "config.json").read_text())
    config.update(changes)
    (model / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


def no_chat_template(model: Path) -> None:
    (model / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def sharded(model: Path) -> None:
    """Two shards named by the index; the second never copied."""
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors"}}))


# (case, how the good directory is spoiled, what the message says after "model.path: DIR")
SPOILED: list[tuple[str, Callable[[Path], None], str]] = [
    ("missing directory", lambda m: shutil.rmtree(m), "no such directory"),
    ("a file", lambda m: shutil.rmtree(m) or m.write_text("x"), "not a directory"),
    ("no config.json", lambda m: (m / "config.json").unlink(), "no config.json"),
    ("empty config.json", lambda m: (m / "config.json").write_text(""), "config.json: empty"),
    ("config.json not JSON", lambda m: (m / "config.json").write_text("{model_type"), "config.json: not valid JSON"),
    ("config.json a list", lambda m: (m / "config.json").write_text("[]"), "config.json: a JSON list, not an object"),
    ("no model_type", lambda m: edit_config(m, model_type=None), "config.json: no model_type"),
    ("no architectures", lambda m: edit_config(m, architectures=None), "config.json: no architectures list"),
    ("no weights", lambda m: (m / "model.safetensors").unlink(), "no weights \\(no \\*.safetensors file"),
    ("only .bin weights", lambda m: (m / "model.safetensors").rename(m / "pytorch_model.bin"),
     "no weights .*PyTorch .bin weights: save them as safetensors"),
    ("a missing shard", sharded, "shard model-00002-of-00002.safetensors of the 2 that "
                                 "model.safetensors.index.json names is missing"),
    ("unknown model_type", lambda m: edit_config(m, model_type="nosuchmodel"),
     "transformers .* cannot load its config.json: .*model type `nosuchmodel`"),
    ("architecture unknown to transformers", lambda m: edit_config(m, architectures=["NoSuchModelForCausalLM"]),
     "architecture NoSuchModelForCausalLM .* is not a class of transformers"),
    ("architecture unknown to vLLM", lambda m: edit_config(m, architectures=["Qwen2ForQuestionAnswering"]),
     "architecture Qwen2ForQuestionAnswering .* is not one that vLLM's model registry runs"),
    ("no tokenizer", lambda m: [p.unlink() for p in m.glob("*") if p.name.startswith(("tokenizer", "chat_template"))],
     "no tokenizer \\(tokenizer.json or tokenizer_config.json\\)"),
    ("tokenizer without a chat template", no_chat_template,
     "the chat format does not build from its tokenizer: .*no chat template"),
]


@pytest.mark.parametrize("spoil,says", [(s, m) for _, s, m in SPOILED], ids=[c for c, _, _ in SPOILED])
def test_each_problem_of_a_model_dir_is_named_with_the_key_and_the_directory(
        good_model: Path, tmp_path: Path, spoil: Callable[[Path], None], says: str) -> None:
    model = copy_of(good_model, tmp_path)
    spoil(model)
    with pytest.raises(ConfigError) as raised:
        preflight.check_job(job_with(model))
    assert raised.value.key == "model.path"
    assert raised.value.message.startswith(str(model))
    assert str(raised.value).startswith(f"job 'quickstart': model.path: {model}")
    assert raised.value.message.count("\n") == 0
    assert re.search(says, raised.value.message), raised.value.message


def test_a_good_model_dir_passes_and_vllm_is_asked_only_for_a_vllm_engine(good_model: Path,
                                                                          vllm_registry: list[bool]) -> None:
    preflight.check_job(job_with(good_model))
    assert vllm_registry == [False]  # a text model: no vision-language registrations
    preflight.check_job(job_with(good_model, "rollout.engine=fake_engine:for_job"))
    assert vllm_registry == [False]


def test_a_vision_config_registers_tiderls_vision_models_first(good_model: Path, tmp_path: Path,
                                                               vllm_registry: list[bool]) -> None:
    model = copy_of(good_model, tmp_path)
    edit_config(model, vision_config={"depth": 1})
    with pytest.raises(ConfigError, match="model.path: .*: trainer.backend torch loads the model with "
                                          "AutoModelForImageTextToText, which has no class for model_type qwen2"):
        preflight.check_job(job_with(model))  # a Qwen2 text config with a vision tower
    assert vllm_registry == [True]


def test_the_trainer_backend_is_checked_with_or_without_a_model(good_model: Path) -> None:
    for model in (None, good_model):
        with pytest.raises(ConfigError, match=r"trainer.backend: unknown trainer backend 'megatron' \(known: fsdp, torch\)"):
            preflight.check_job(job_with(model, "trainer.backend=megatron"))
    preflight.check_job(job_with(None))  # the tiny model: nothing of it checked
    from tiderl.trainer import registry

    with pytest.MonkeyPatch.context() as mp:  # a plugin's module must import
        mp.setitem(registry.BACKENDS, "plugin", "no_such_module:make")
        with pytest.raises(ConfigError, match="trainer.backend: plugin: no_such_module:make cannot be loaded: "
                                              "ModuleNotFoundError"):
            preflight.check_job(job_with(None, "trainer.backend=plugin"))
    preflight.check_job(job_with(good_model, "trainer.backend=fsdp"))
    preflight.check_job(job_with(None, "trainer.backend=fsdp", "trainer.actor_ranks=2", "launch.num_ranks=4"))
    # ERS may move a sharded actor's ranks: the state is checked in and re-sharded (tiderl.run.handoff).
    preflight.check_job(job_with(None, "trainer.backend=fsdp", "ers.elastic_actors=true"))


def test_tiderl_config_names_the_problem_and_prints_no_config(good_model: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from tiderl.cli import main

    model = copy_of(good_model, tmp_path)
    (model / "config.json").write_text("")
    assert main(["config", str(JOB), "--set", f"model.path={model}"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert f"tiderl config: config error: job 'quickstart': model.path: {model}/config.json: empty" in out.err
    assert main(["config", str(JOB), "--set", f"model.path={good_model}"]) == 0
    out = capsys.readouterr().out
    assert f"path: {good_model}" in out
    # Each rank's memory plan after the config, as comments (fp32 on a CPU-only job): the output stays YAML.
    assert "\n# memory per GPU (" in out and "\n#   actor: " in out and "\n#   rollout: " in out


def test_a_job_whose_ranks_do_not_fit_its_gpus_is_refused_with_the_numbers(
        good_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tiderl.cli import main

    gpus = ["--set", "slurm.gpus_per_node=2", "--set", f"model.path={good_model}"]
    assert main(["config", str(JOB), *gpus, "--set", "slurm.gpu_memory_gib=0.001"]) == 2
    err = capsys.readouterr().err
    assert "slurm.gpu_memory_gib: the ranks do not fit GPUs of 0.001 GiB: actor: " in err and "optimizer" in err
    assert main(["config", str(JOB), *gpus, "--set", "slurm.gpu_memory_gib=80"]) == 0
    assert "KV cache holds" in capsys.readouterr().out


def test_tiderl_config_without_model_path_imports_neither_torch_nor_vllm() -> None:
    # Nor do the pre-flight checks of a job without a model (tiderl submit's, tiderl run's).
    code = ("import sys; from tiderl.cli import main; assert main(['config', 'jobs/quickstart.yaml']) == 0; "
            "from tiderl.config import load_job; from tiderl.models.preflight import check_job; "
            "assert check_job(load_job('jobs/quickstart.yaml', ['trainer.backend=fsdp'])) is None; "
            "print(sorted({'torch', 'transformers', 'vllm'} & set(sys.modules)), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip().splitlines()[-1] == "[]"


def test_tiderl_run_with_a_bad_model_creates_no_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from tiderl.cli import main

    launched: list[object] = []
    monkeypatch.setattr("tiderl.run.launcher.run_launch", lambda launch, *a, **k: launched.append(launch) or 0)
    run_dir, model = tmp_path / "run", tmp_path / "no-model"
    assert main(["run", str(JOB), "--set", f"model.path={model}", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert f"tiderl run: config error: job 'quickstart': model.path: {model}: no such directory" in err
    assert not run_dir.exists() and launched == []


def test_tiderl_run_resume_checks_a_moved_model_and_leaves_the_run_dir_alone(
        good_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from tiderl.cli import main
    from tiderl.rundir import create_run

    model = copy_of(good_model, tmp_path)
    paths, store = create_run(job_with(model), tmp_path / "run")
    store.close()
    shutil.move(model, tmp_path / "moved")

    def snapshot() -> dict[str, tuple[int, int]]:
        return {str(p.relative_to(paths.root)): (p.stat().st_size, p.stat().st_mtime_ns)
                for p in paths.root.rglob("*")}

    before = snapshot()
    launched: list[object] = []
    monkeypatch.setattr("tiderl.run.launcher.run_launch", lambda launch, *a, **k: launched.append(launch) or 0)
    assert main(["run", "--resume", str(paths.root)]) == 2
    assert f"model.path: {model}: no such directory" in capsys.readouterr().err
    assert snapshot() == before and launched == []


def test_tiderl_submit_dry_run_with_a_bad_model_prints_no_script_and_creates_nothing(
        good_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tiderl.cli import main

    model = copy_of(good_model, tmp_path)
    sharded(model)
    run_dir = tmp_path / "run"
    assert main(["submit", str(JOB), "--set", f"model.path={model}", "--run-dir", str(run_dir), "--dry-run"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert (f"tiderl submit: config error: job 'quickstart': model.path: {model}: shard "
            "model-00002-of-00002.safetensors of the 2 that model.safetensors.index.json names is missing") in out.err
    assert not run_dir.exists()


def test_vllms_architectures_are_read_from_the_cache_of_its_version(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A filled cache answers without importing vLLM; the text and the vision lists are kept apart."""
    monkeypatch.setenv("TIDERL_CACHE", str(tmp_path))
    text, vision = preflight.registry_cache_file(False), preflight.registry_cache_file(True)
    assert text != vision and text.parent == tmp_path / "vllm-registry" and text.name.startswith("vllm")
    text.parent.mkdir(parents=True)
    text.write_text(json.dumps(["OnlyThisForCausalLM"]))
    assert REAL_VLLM_ARCHITECTURES(False) == {"OnlyThisForCausalLM"}


@pytest.mark.slow
def test_vllms_own_registry_runs_the_model_and_not_an_architecture_it_lacks(
        good_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM imported for real (tens of seconds on a busy 2-core machine); no engine started. The list it
    gave is kept for the next check."""
    monkeypatch.setenv("TIDERL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(preflight, "vllm_architectures", REAL_VLLM_ARCHITECTURES)
    preflight.check_job(job_with(good_model))
    assert "Qwen2ForCausalLM" in json.loads(preflight.registry_cache_file(False).read_text())
    model = copy_of(good_model, tmp_path)
    edit_config(model, architectures=["Qwen2ForQuestionAnswering"])  # a class of transformers, not of vLLM
    with pytest.raises(ConfigError, match="is not one that vLLM's model registry runs"):
        preflight.check_job(job_with(model))
