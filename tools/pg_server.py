"""Start a throw-away PostgreSQL server (initdb + pg_ctl in a temporary directory) for tests and benchmarks.

A real server, as a cluster's database would be: the run store's PostgreSQL
backend is tested against it, never against a mock. It listens on 127.0.0.1 on
a free port (and on a unix socket in its data directory), trusts local
connections, and is stopped and removed on exit.

PostgreSQL refuses to run as root: as root, the server runs as an unprivileged
user (`postgres` from Debian's package, else `nobody`) that owns the data
directory. Needs Debian's `postgresql` package (`/usr/lib/postgresql/*/bin`).

    python tools/pg_server.py          # start one, print its URL, stop on Ctrl-C
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

SUPERUSER = "tiderl"
DATABASE = "tiderl"


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server binaries here, or the server did not start (the message says which)."""


@dataclass(frozen=True)
class PgServer:
    host: str
    port: int
    data_dir: Path
    bindir: Path
    user: str | None  # the user the server runs as (None: this process's)

    def stop(self) -> None:
        """Stop the server at once (`-m fast`: open transactions are cut off), as an outage would."""
        _pg_ctl(self, "-m", "fast", "-w", "stop", check=True)

    def start(self) -> None:
        """Start it again on the same port and data."""
        _pg_ctl(self, "-l", str(self.data_dir.parent / "server.log"), "-w", "-t", "60", "start", check=True)

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the test database (psycopg 3 driver)."""
        return f"postgresql+psycopg://{SUPERUSER}@{self.host}:{self.port}/{DATABASE}"

    @property
    def libpq_url(self) -> str:
        """The same database as `psql` takes it."""
        return f"postgresql://{SUPERUSER}@{self.host}:{self.port}/{DATABASE}"


def pg_bindir() -> Path:
    """Directory holding initdb, pg_ctl and postgres: $TIDERL_PG_BINDIR, else the newest Debian install, else PATH."""
    if os.environ.get("TIDERL_PG_BINDIR"):
        candidates = [os.environ["TIDERL_PG_BINDIR"]]
    else:
        found = glob.glob("/usr/lib/postgresql/*/bin")
        candidates = sorted(found, key=lambda p: int(Path(p).parent.name) if Path(p).parent.name.isdigit() else 0,
                            reverse=True)
        on_path = shutil.which("initdb")
        if on_path:
            candidates.append(str(Path(on_path).parent))
    for d in candidates:
        if all((Path(d) / exe).is_file() for exe in ("initdb", "pg_ctl", "postgres")):
            return Path(d)
    raise PostgresUnavailable("no PostgreSQL server binaries (initdb, pg_ctl, postgres) in /usr/lib/postgresql/*/bin "
                              "or on PATH: install Debian's postgresql package (make setup does, as root)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_user() -> str | None:
    """The user the server runs as: None (ourselves) unless we are root, which PostgreSQL refuses."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise PostgresUnavailable("running as root and neither a 'postgres' nor a 'nobody' user exists to run the "
                              "server as (PostgreSQL refuses root)")


def _as(user: str | None, argv: list[str]) -> list[str]:
    return argv if user is None else ["runuser", "-u", user, "--", *argv]


def _pg_ctl(server: PgServer, *args: str, check: bool) -> None:
    run = subprocess.run(_as(server.user, [str(server.bindir / "pg_ctl"), "-D", str(server.data_dir), *args]),
                         capture_output=True, text=True)
    if check and run.returncode != 0:
        raise PostgresUnavailable(f"pg_ctl {' '.join(args)} failed (exit {run.returncode}): {run.stderr.strip()}")


@contextmanager
def postgres_server(*, port: int | None = None, max_connections: int = 200,
                    settings: dict[str, str] | None = None) -> Iterator[PgServer]:
    """A running PostgreSQL server with an empty database `tiderl` (superuser `tiderl`, trust auth); stopped
    and its data directory removed on exit. `settings` override postgresql.conf's test settings (e.g.
    `{"fsync": "on", "synchronous_commit": "on"}` for a benchmark that should pay for durable commits)."""
    bindir = pg_bindir()
    user = _server_user()
    # Under /tmp, not pytest's tmp_path: that one is private to root (mode 700), the server's user could
    # not reach its own data directory there.
    base = Path(tempfile.mkdtemp(prefix="tiderl-pg-"))
    data = base / "data"
    log = base / "server.log"
    if user is not None:
        pw = pwd.getpwnam(user)
        os.chown(base, pw.pw_uid, pw.pw_gid)
    port = port or _free_port()
    started = False
    try:
        run = subprocess.run(_as(user, [str(bindir / "initdb"), "-D", str(data), "-U", SUPERUSER, "--auth=trust",
                                        "--encoding=UTF8", "--locale=C", "--no-sync"]),
                             capture_output=True, text=True)
        if run.returncode != 0:
            raise PostgresUnavailable(f"initdb failed (exit {run.returncode}): {run.stderr.strip()[-2000:]}")
        # Test settings: a small server, fast commits (fsync off: the tests kill no machine), a socket in its dir.
        conf = {"listen_addresses": "'127.0.0.1'", "port": str(port), "unix_socket_directories": f"'{base}'",
                "max_connections": str(max_connections), "shared_buffers": "64MB", "fsync": "off",
                "synchronous_commit": "off", "full_page_writes": "off"} | (settings or {})
        with open(data / "postgresql.conf", "a") as f:
            f.write("\n" + "".join(f"{k} = {v}\n" for k, v in conf.items()))
        run = subprocess.run(_as(user, [str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", "60",
                                        "start"]), capture_output=True, text=True)
        tail = log.read_text()[-2000:] if log.exists() else ""
        if run.returncode != 0:
            raise PostgresUnavailable(f"pg_ctl start failed (exit {run.returncode}): {run.stderr.strip()} {tail}")
        started = True
        run = subprocess.run(_as(user, [str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port),
                                        "-U", SUPERUSER, DATABASE]), capture_output=True, text=True)
        if run.returncode != 0:
            raise PostgresUnavailable(f"createdb failed: {run.stderr.strip()}")
        yield PgServer(host="127.0.0.1", port=port, data_dir=data, bindir=bindir, user=user)
    finally:
        if started:  # stopped already if a test stopped it and did not start it again: nothing to do then
            _pg_ctl(PgServer("127.0.0.1", port, data, bindir, user), "-m", "fast", "-w", "stop", check=False)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    with postgres_server() as server:
        print(server.url, flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            sys.exit(0)
