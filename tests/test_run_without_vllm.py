"""A whole local `tiderl run` without vLLM: the launcher, the control plane, env servers, rank processes with
the rollout, actor and ref roles and the torch trainer, all for real; only the engine is the tests' scripted
one (`rollout.engine: fake_engine:for_job`, tests/fake_engine.py). So the fast tests reach every line the run's
processes execute but the vLLM engine's own (issue 17's coverage target)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fake_engine import SCRIPTED_ENGINE, scripted_run_env
from run_checks import check_run, shared_memory_left_behind

ROOT = Path(__file__).resolve().parents[1]
SCRIPTED = [f"rollout.engine={SCRIPTED_ENGINE}", "model.init_train_steps=5", "trainer.num_steps=3",
            "trainer.groups_min=1", "trainer.groups_ideal=2", "rollout.group_size=4", "rollout.max_concurrency=8",
            "rollout.eval_every_steps=2", "rollout.eval_groups=2", "trainer.checkpoint_every=2"]


def tiderl(*args: str, timeout_s: float = 600, cache: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tiderl", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s, env=scripted_run_env(cache))


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model cache of these tests' own: the first run builds its tiny model (a short warm start) as a new
    user's first run does, the next finds it built."""
    return tmp_path_factory.mktemp("cache")


# A shared host of 2 slots where a rollout rank weighs 1.5: the cold start parks a rank IDLE (tiderl.policy.ers).
SHARED_HOST = ["ers.host_slots=2", "ers.rollout_host_weight=1.5"]


TRANSFER = ["trainer.weight_sync=transfer"]


@pytest.mark.parametrize("system,extra", [("tiderl", TRANSFER), ("sync", TRANSFER), ("stream", []), ("tiderl", SHARED_HOST),
                                          ("tiderl", SHARED_HOST + ["ers.idle_engines=parked"])],
                         ids=["tiderl", "sync", "stream", "tiderl-shared-host", "tiderl-shared-host-parked"])
def test_a_whole_local_run_with_a_scripted_engine(tmp_path: Path, system: str, extra: list[str], cache: Path) -> None:
    run_dir = tmp_path / "run"
    sets = SCRIPTED + [f"system={system}"] + extra
    out = tiderl("run", "jobs/quickstart.yaml", *[a for s in sets for a in ("--set", s)], "--run-dir", str(run_dir),
                 cache=cache)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    status = json.loads(tiderl("status", str(run_dir), "--json").stdout)
    assert status["state"] == "finished" and status["version"] == 3
    assert status["goodput_tok_s"] > 0
    facts = check_run(run_dir, max_staleness=0 if system == "sync" else 1)
    assert facts["versions"] == 3
    logs = {p.name: p.read_text() for p in (run_dir / "logs").glob("rank*.log")}
    assert f"{SCRIPTED_ENGINE} engine up" in "".join(logs.values())
    # ERS's idle rank on a shared host starts its engine only when asked (engines on demand: the control plane's
    # `engine_wanted` event), or at once with `ers.idle_engines: parked`, so that a move to rollout costs a
    # reload; a fixed split's spare (sync's and stream's rank 3) starts nothing.
    from tiderl.store import RunStore

    store = RunStore.for_run_dir(run_dir, read_only=True)
    try:
        asked = store.ranks_with_event("engine_wanted", since_start=False)
        # Weights without files (trainer.weight_sync: transfer): the rollout ranks pulled the versions from the
        # trainer leader's server, every bucket checked; with files, they read weights/vN.
        received = {r["version"] for r in store.reader.metric_rows(["weights_transfer_stall_s"])}
        mapped = {r["version"] for r in store.reader.metric_rows(["weights_shared_memory_bytes"])}
        read = {r["version"] for r in store.reader.metric_rows(["weights_files_stall_s"])}
        failed = store.recent_events(kinds=["weights_transfer_failed"])
    finally:
        store.close()
    if extra == TRANSFER:
        assert received and max(received) >= 2 and not read and not failed, (received, read, failed)
        assert mapped == received  # every engine is on the leader's host: it mapped each version
        assert not shared_memory_left_behind()  # the leader's weight server removed its buckets
    else:
        assert read and max(read) >= 2 and not received, (received, read)
    idle = [name for name, text in logs.items() if "role idle from" in text]
    # sync's and stream's spare rank is idle (their fixed split); without a shared host ERS parks no rank
    assert bool(idle) == (system in ("sync", "stream") or "ers.host_slots=2" in extra)
    for name in idle:
        wanted = system == "tiderl" and ("ers.idle_engines=parked" in extra or int(name[4:].split(".")[0]) in asked)
        assert (f"{SCRIPTED_ENGINE} engine up" in logs[name]) == wanted, name


def test_an_engine_that_cannot_be_loaded_is_a_config_error(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = tiderl("run", "jobs/quickstart.yaml", "--set", "rollout.engine=fake_engine:no_such_factory",
                 "--run-dir", str(run_dir))
    assert out.returncode == 2 and "rollout.engine" in out.stderr and "no_such_factory" in out.stderr, out.stderr
    assert not run_dir.exists()
    out = tiderl("run", "jobs/quickstart.yaml", "--set", "rollout.engine=not a factory", "--run-dir", str(run_dir))
    assert out.returncode == 2 and "MODULE:FUNCTION" in out.stderr, out.stderr


def test_ctrl_c_stops_every_rank_cleanly_and_the_run_resumes(tmp_path: Path, cache: Path) -> None:
    """Ctrl-C on `tiderl run`: the launcher stops its ranks by signal (each records itself `stopped`), the run
    is `cancelled`; `--resume` carries it on to the end with nothing lost or trained twice."""
    import signal
    import time

    from tiderl.store import RunStore
    from tiderl.store.engine import StoreError

    run_dir = tmp_path / "run"
    steps = 12  # each takes seconds (0.3 s environment steps): Ctrl-C after the first lands long before the end
    sets = SCRIPTED + [f"trainer.num_steps={steps}", "env.latency=fixed:0.3"]
    proc = subprocess.Popen([sys.executable, "-m", "tiderl", "run", "jobs/quickstart.yaml",
                             *[a for s in sets for a in ("--set", s)], "--run-dir", str(run_dir)],
                            cwd=ROOT, env=scripted_run_env(cache), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            # SIGINT as at a terminal: a test run started in the background (`cmd &` in a script)
                            # ignores it, and its children inherit that, so Ctrl-C would never reach the launcher.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300
    version = 0
    while version < 1 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
        try:
            store = RunStore.for_run_dir(run_dir, read_only=True)  # only looks, as `tiderl status`
            try:
                version = store.run_info().version
            finally:
                store.close()
        except (StoreError, FileNotFoundError, OSError):
            pass
    assert proc.poll() is None and version >= 1, "the run ended or stalled before version 1"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    status = json.loads(tiderl("status", str(run_dir), "--json").stdout)
    assert status["state"] == "cancelled" and status["version"] < steps, out[-3000:]
    assert all(r["state"] in ("stopped", "finished") for r in status["ranks"]), status["ranks"]
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("rank*.log"))
    assert "stopped by signal" in logs
    resumed = tiderl("run", "--resume", str(run_dir), cache=cache)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert json.loads(tiderl("status", str(run_dir), "--json").stdout)["version"] == steps
    assert check_run(run_dir, max_staleness=1)["versions"] == steps


@pytest.mark.slow
def test_a_run_shards_its_data_parallel_actor_with_fsdp(tmp_path: Path, cache: Path) -> None:
    """`trainer.backend: fsdp` with two actor ranks and a decoupled ref rank: the actor is built inside the
    trainer group, sharded over both actors, which train every step; the ref serves them; the leader publishes
    the gathered weights (a model directory transformers loads) and each actor writes its shards of the
    checkpoint of step 2. The follower and the ref record their waits for the leader's data; every process
    serves its Prometheus registry."""
    import sqlite3

    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    sets = SCRIPTED + ["system=async", "trainer.backend=fsdp", "trainer.ra2p_mode=decoupled", "launch.num_ranks=4",
                       "trainer.actor_ranks=2", "launch.rollout_fraction=0.25", "monitor.metrics_port=0"]
    out = tiderl("run", "jobs/quickstart.yaml", *[a for s in sets for a in ("--set", s)], "--run-dir", str(run_dir),
                 cache=cache)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert check_run(run_dir, max_staleness=1)["versions"] == 3
    db = sqlite3.connect(run_dir / "run.db")
    try:
        trained = dict(db.execute("select rank, count(*) from metrics where name = 'train_s' group by rank").fetchall())
        roles = dict(db.execute("select rank, role from control where version = 0").fetchall())
        modes = {m for (m,) in db.execute("select ra2p_mode from versions where version > 0")}
        waited = dict(db.execute("select rank, count(distinct version) from metrics where name = 'twt_s' "
                                 "and rank in (1, 3) group by rank").fetchall())
    finally:
        db.close()
    assert trained == {0: 3, 1: 3}, "both actors train every step"
    assert roles == {0: "actor", 1: "actor", 2: "rollout", 3: "ref"} and modes == {"decoupled"}
    assert waited == {1: 3, 3: 3}
    urls = sorted(p.name for p in (run_dir / "metrics").glob("*.url"))
    assert urls == ["control.url", "rank0.url", "rank1.url", "rank2.url", "rank3.url"]
    # Each actor holds half of the parameters (the tied output layer is the embedding), built once: the group held.
    import re

    held = {rank: [int(n) for n in re.findall(r"fsdp actor built in the group, (\d+) parameters held here",
                                              (run_dir / "logs" / f"rank{rank}.log").read_text())] for rank in (0, 1)}
    total = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(run_dir / "weights" / "v3").parameters())
    assert len(held[0]) == len(held[1]) == 1 and held[0][0] + held[1][0] == total, (held, total)
    published = AutoModelForCausalLM.from_pretrained(run_dir / "weights" / "v3").state_dict()
    # The checkpoint of step 2: each actor wrote its own shards (DCP), the moments keyed by parameter name.
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = run_dir / "ckpt" / "step2"
    assert {p.name for p in ckpt.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    moments = {k[len("optimizer.state."):].rsplit(".", 1)[0] for k in keys if k.startswith("optimizer.state.")}
    assert moments and moments <= set(published), "moments keyed by parameter name"


@pytest.mark.slow
def test_elastic_actors_join_and_leave_with_the_groups_state(tmp_path: Path, cache: Path) -> None:
    """`ers.elastic_actors`: ERS moves data-parallel actor ranks to and from rollout at boundaries (a tiny HoL
    tau makes any waiting micro-batch a consumption deficit, an empty buffer a generation deficit); an actor
    that joins takes the group's weights and optimizer state, nothing is lost; a rank that leaves rollout for
    the trainer frees its engine's memory first (the scripted engine does, as vLLM's sleep mode on a GPU)."""
    import sqlite3

    run_dir = tmp_path / "run"
    sets = SCRIPTED + ["system=tiderl", "trainer.num_steps=6", "launch.num_ranks=4", "trainer.actor_ranks=2",
                       "launch.rollout_fraction=0.5", "ers.elastic_actors=true", "ers.max_ref_ranks=0",
                       "ers.policy=paper", "ers.hol_tau=0.001", "trainer.checkpoint_every=100",
                       "rollout.eval_every_steps=0"]
    out = tiderl("run", "jobs/quickstart.yaml", *[a for s in sets for a in ("--set", s)], "--run-dir", str(run_dir),
                 cache=cache)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert check_run(run_dir, max_staleness=1)["versions"] == 6
    db = sqlite3.connect(run_dir / "run.db")
    try:
        actors: dict[int, set[int]] = {}
        for version, rank in db.execute("select version, rank from control where role = 'actor'"):
            actors.setdefault(version, set()).add(rank)
        trained = db.execute("select version, count(*) from metrics where name = 'train_s' group by version").fetchall()
        released = {r for (r,) in db.execute("select rank from events where kind = 'engine_released'")}
        engines = {r for (r,) in db.execute("select rank from events where kind = 'engine_up'")}
    finally:
        db.close()
    joined = {v: actors[v] - actors[v - 1] for v in range(1, 6) if actors[v] - actors[v - 1]}
    assert joined, f"no actor rank joined in 6 steps: {actors}"
    took = "".join((run_dir / "logs" / f"rank{r}.log").read_text() for r in range(4)).count("from the group, held")
    assert took >= len(joined), (joined, took)
    # every actor of a step trained it (the joiners too)
    assert all(n == len(actors[v]) for v, n in trained), (trained, actors)
    # a joiner that had rolled out freed its engine's memory for the trainer
    movers = {r for ranks in joined.values() for r in ranks} & engines
    assert movers and movers <= released, (movers, released)
