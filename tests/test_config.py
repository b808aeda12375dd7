"""Job config loading: every kind of bad input names the file, the key and what was expected."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from tiderl.cli import main
from tiderl.config import ConfigError, JobConfig, dump_job, load_job
from tiderl.config.schema import iter_fields

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(text)
    return p


def test_quickstart_loads_and_is_frozen() -> None:
    cfg = load_job(ROOT / "jobs" / "quickstart.yaml")
    assert cfg.system == "tiderl"
    assert cfg.launch.num_ranks == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.trainer.num_steps = 5  # type: ignore[misc]


def test_every_job_file_loads() -> None:
    for path in sorted((ROOT / "jobs").glob("*.yaml")):
        load_job(path)


def test_override_sets_nested_field_with_yaml_typing(tmp_path: Path) -> None:
    p = write(tmp_path, "system: sync\n")
    cfg = load_job(p, ["trainer.num_steps=3", "trainer.lr=0.5", "env.servers=[http://a:1, http://b:2]"])
    assert cfg.trainer.num_steps == 3
    assert cfg.trainer.lr == 0.5
    assert cfg.env.servers == ("http://a:1", "http://b:2")


def test_unknown_key_names_file_key_and_known_keys(tmp_path: Path) -> None:
    p = write(tmp_path, "system: tiderl\ntrainer:\n  num_stepz: 3\n")
    with pytest.raises(ConfigError) as e:
        load_job(p)
    assert str(p) in str(e.value)
    assert "trainer.num_stepz" in str(e.value)
    assert "unknown key" in str(e.value) and "num_steps" in str(e.value)


def test_unknown_section(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"trainr: unknown key"):
        load_job(write(tmp_path, "system: tiderl\ntrainr: {}\n"))


def test_wrong_type(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"trainer.num_steps: expected an integer, got 'ten'"):
        load_job(write(tmp_path, "system: tiderl\ntrainer:\n  num_steps: ten\n"))


def test_bool_is_not_an_integer(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"launch.num_ranks: expected an integer, got True"):
        load_job(write(tmp_path, "system: tiderl\nlaunch:\n  num_ranks: true\n"))


def test_out_of_range(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"launch.num_ranks: must be >= 2, got 1"):
        load_job(write(tmp_path, "system: tiderl\nlaunch:\n  num_ranks: 1\n"))


def test_bad_choice(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"system: expected one of 'tiderl', 'sync', 'async', 'stream'"):
        load_job(write(tmp_path, "system: verl\n"))


def test_missing_required(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"job.yaml: system: missing required key"):
        load_job(write(tmp_path, "name: x\n"))


def test_cross_field_check_names_the_field(tmp_path: Path) -> None:
    text = "system: tiderl\ntrainer:\n  groups_min: 8\n  groups_ideal: 4\n"
    with pytest.raises(ConfigError, match=r"trainer.groups_ideal: must be >= groups_min"):
        load_job(write(tmp_path, text))


def test_section_must_be_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"trainer: expected a mapping"):
        load_job(write(tmp_path, "system: tiderl\ntrainer: 3\n"))


def test_invalid_yaml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_job(write(tmp_path, "system: [tiderl\n"))
    with pytest.raises(ConfigError, match="job file not found"):
        load_job(tmp_path / "nope.yaml")


def test_bad_override_blames_the_override(tmp_path: Path) -> None:
    p = write(tmp_path, "system: tiderl\n")
    with pytest.raises(ConfigError, match=r"^--set trainer.num_steps=-1: trainer.num_steps: must be >= 1"):
        load_job(p, ["trainer.num_steps=-1"])
    with pytest.raises(ConfigError, match=r"expected KEY=VALUE"):
        load_job(p, ["trainer.num_steps"])
    with pytest.raises(ConfigError, match=r"trainer.bogus: unknown key"):
        load_job(p, ["trainer.bogus=1"])


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    cfg = load_job(ROOT / "jobs" / "quickstart.yaml", ["trainer.num_steps=3"])
    again = load_job(write(tmp_path, dump_job(cfg)))
    assert again == cfg


def test_every_field_is_documented() -> None:
    for key, _tp, f in iter_fields(JobConfig):
        assert f.metadata.get("help"), f"config field {key} has no help text"


def test_cli_config_error_exit_code_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = write(tmp_path, "system: tiderl\ntrainer:\n  num_steps: 0\n")
    assert main(["config", str(p)]) == 2
    err = capsys.readouterr().err
    assert "trainer.num_steps: must be >= 1, got 0" in err and str(p) in err


def test_cli_config_prints_resolved(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", str(ROOT / "jobs" / "quickstart.yaml"), "--set", "trainer.num_steps=3"]) == 0
    assert "num_steps: 3" in capsys.readouterr().out


def test_console_script_exit_code(tmp_path: Path) -> None:
    p = write(tmp_path, "system: tiderl\nbogus: 1\n")
    r = subprocess.run([sys.executable, "-m", "tiderl", "config", str(p)], capture_output=True, text=True)
    assert r.returncode == 2
    assert "bogus: unknown key" in r.stderr


@pytest.mark.parametrize(("text", "value"), [("1e-4", 1e-4), ("1E5", 1e5), ("+2.5e-3", 2.5e-3), (".5e1", 5.0),
                                             ("3.", 3.0), ("1.0e-6", 1e-6), ("0.5", 0.5), ("2", 2.0)])
def test_numbers_in_yaml_1_2_notation(tmp_path: Path, text: str, value: float) -> None:
    # YAML 1.1 (PyYAML) reads 1e-4 as a string; a job file and --set read it as YAML 1.2 does.
    assert load_job(write(tmp_path, f"system: sync\ntrainer:\n  lr: {text}\n")).trainer.lr == value
    assert load_job(write(tmp_path, "system: sync\n"), [f"trainer.lr={text}"]).trainer.lr == value


def test_integers_stay_integers_and_words_stay_words(tmp_path: Path) -> None:
    cfg = load_job(write(tmp_path, "system: sync\nname: 1e\ntrainer:\n  num_steps: 3\n"))
    assert cfg.trainer.num_steps == 3 and isinstance(cfg.trainer.num_steps, int)
    assert cfg.name == "1e"


def test_a_key_given_twice_is_an_error_naming_both_lines(tmp_path: Path) -> None:
    p = write(tmp_path, "system: sync\ntrainer:\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match=r"key 'lr' is given twice \(first on line 3\)") as e:
        load_job(p)
    assert f'in "{p}", line 4' in str(e.value)


def test_yaml_syntax_errors_name_the_file(tmp_path: Path) -> None:
    p = write(tmp_path, "system: [tiderl\n")
    with pytest.raises(ConfigError) as e:
        load_job(p)
    assert f'in "{p}"' in str(e.value) and "<unicode string>" not in str(e.value)


def test_unknown_key_suggests_the_close_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"trainer.num_stepz: unknown key \(did you mean 'num_steps'\?"):
        load_job(write(tmp_path, "system: sync\ntrainer:\n  num_stepz: 3\n"))
    with pytest.raises(ConfigError) as e:
        load_job(write(tmp_path, "system: sync\ntrainer:\n  zzzz: 3\n"))
    assert "did you mean" not in str(e.value)


def test_bare_tiderl_prints_help_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    assert "COMMAND" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    from tiderl import __version__
    assert capsys.readouterr().out.strip() == f"tiderl {__version__}"


def test_output_into_a_closed_pipe_ends_quietly() -> None:
    # `tiderl config JOB | head -1`: the reader has gone. The read end is closed before the
    # command writes, so its first write fails: quiet, with the shell's SIGPIPE status.
    job = ROOT / "jobs" / "quickstart.yaml"
    proc = subprocess.Popen([sys.executable, "-m", "tiderl", "config", str(job)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141
    assert "Traceback" not in err and "BrokenPipe" not in err, err
