from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

pytest_plugins = ["pg_fixtures"]  # pg_server (a real PostgreSQL for the store tests), store_url


SLURM_FILES = "test_slurm_"  # the test files that may use the dev cluster: one pytest-xdist worker runs them all


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """Under pytest-xdist with `--dist loadscope` (tools/run_tests.sh): a test file runs whole in one worker, so a
    module's fixture (a vLLM engine, a short real run) is built once; and the Slurm test files run in one worker,
    one after the other, as they share the dev cluster (one of them kills and restarts it)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileScopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "slurm" if Path(path).name.startswith(SLURM_FILES) else path

    return FileScopes(config, log)  # type: ignore[arg-type]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A `slurm` test outside the Slurm test files would share the dev cluster with them at the same time."""
    stray = [item.nodeid for item in items
             if item.get_closest_marker("slurm") and not item.path.name.startswith(SLURM_FILES)]
    if stray:
        raise pytest.UsageError(f"slurm tests belong in tests/{SLURM_FILES}*.py (one worker runs those): {stray}")


@pytest.fixture(scope="session")
def juicefs_dir(tmp_path_factory: pytest.TempPathFactory):
    """A directory on a real JuiceFS mount (FUSE). CI sets TIDERL_REQUIRE_JUICEFS=1 so a missing mount fails."""
    from jfs_mount import JuiceFSUnavailable, juicefs_mount

    try:
        with juicefs_mount(tmp_path_factory.mktemp("juicefs")) as mnt:
            yield mnt
    except JuiceFSUnavailable as e:
        if os.environ.get("TIDERL_REQUIRE_JUICEFS") == "1":
            pytest.fail(f"JuiceFS required but unavailable: {e}")
        pytest.skip(f"JuiceFS unavailable: {e}")


@pytest.fixture(params=["local", "juicefs"])
def store_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A fresh directory for a run store, on local disk and on JuiceFS."""
    if request.param == "local":
        return tmp_path
    base = request.getfixturevalue("juicefs_dir") / tmp_path.name
    base.mkdir()
    return base


@pytest.fixture(scope="session")
def quickstart_model() -> Path:
    """The quickstart job's tiny model (built once per machine, then found in the cache): every test that
    needs a warm-started text model uses this one, so a fresh machine builds one."""
    from tiderl.config.job import load_job
    from tiderl.models import for_job

    return for_job.model_dir(load_job(ROOT / "jobs" / "quickstart.yaml"))


@pytest.fixture(scope="module")
def slurm_cluster():
    """The running dev cluster, with SLURM_CONF exported for every client (submitit included). The
    `slurm` tests skip without one unless TIDERL_REQUIRE_SLURM=1 (CI), then fail."""
    from tiderl.slurm.cluster import SlurmCluster, SlurmUnavailable

    default = Path(os.environ.get("TIDERL_SLURM_DIR", "/tmp/tiderl-slurm")) / "etc" / "slurm.conf"
    conf = os.environ.get("SLURM_CONF") or str(default)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", conf)
        cluster = SlurmCluster()
        try:
            if not Path(conf).is_file():
                raise SlurmUnavailable(f"no Slurm config at {conf}")
            cluster.ping()
        except SlurmUnavailable as e:
            message = f"Slurm dev cluster not running (start it with slurm/dev-cluster-start.sh): {e}"
            if os.environ.get("TIDERL_REQUIRE_SLURM") == "1":
                pytest.fail(message)
            pytest.skip(message)
        yield cluster
