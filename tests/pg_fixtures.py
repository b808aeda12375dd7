"""A real PostgreSQL server for the run-store tests, started once per test session and stopped at its end.

`pg_server` starts it (tools/pg_server.py: initdb + pg_ctl in a temporary
directory, as an unprivileged user when the tests run as root). Without
PostgreSQL's server binaries the PostgreSQL tests skip, naming what is missing,
unless TIDERL_REQUIRE_POSTGRES=1 (CI), where they fail. `store_url` runs a test
once per backend: None (SQLite in the run directory) and the server's URL.
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest


@pytest.fixture(scope="session")
def pg_server() -> Iterator[object]:
    from pg_server import PostgresUnavailable, postgres_server

    try:
        with postgres_server() as server:
            yield server
    except PostgresUnavailable as e:
        if os.environ.get("TIDERL_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"PostgreSQL required but unavailable: {e}")
        pytest.skip(f"PostgreSQL unavailable: {e}")


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest) -> str | None:
    """`store.url` of one backend: None (SQLite, RUN_DIR/run.db) or the test server's database."""
    if request.param == "sqlite":
        return None
    return request.getfixturevalue("pg_server").url
