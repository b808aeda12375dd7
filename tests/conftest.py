from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))


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
