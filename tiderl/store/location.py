"""Where a run's store lives: which backend a `store.url` names, and each run's own place on a server.

SQLite (the default) keeps the store in the run directory: `RUN_DIR/run.db`.
PostgreSQL keeps it on a server many runs share, so each run gets its own
PostgreSQL schema (namespace) in the database `store.url` names: two runs of
one job file, which carry the same `store.url`, never see each other's rows.
The schema is named after the run directory (`run_<dir name>_<hash of its
path>`), and the run directory records the full URL (`RUN_DIR/store.url`):
every later process of the run (ranks, `tiderl status`, a resume) opens the
store the run was created in, whatever config it was started with.
"""

from __future__ import annotations

import hashlib
import re
import urllib.parse
from pathlib import Path

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from tiderl.store.engine import StoreError

POINTER_FILE = "store.url"  # RUN_DIR/store.url: the URL of a run store that is not RUN_DIR/run.db
POSTGRES_DRIVER = "postgresql+psycopg"


class StoreURLError(StoreError):
    """`store.url` is not a URL of a backend the run store runs on."""


def parse_store_url(url: str) -> URL:
    """The URL, checked: SQLite, or PostgreSQL through psycopg 3 (`postgresql://` and `postgres://` mean that).
    Anything else is refused here, before a rank starts, with the fix in the message."""
    try:
        parsed = make_url(url)
    except ArgumentError as e:
        raise StoreURLError(f"store.url {redact(url)!r} is not a database URL (want sqlite:///PATH or "
                            f"{POSTGRES_DRIVER}://USER@HOST:PORT/DB)") from e
    backend, _, driver = parsed.drivername.partition("+")
    if backend == "sqlite" and driver in ("", "pysqlite"):
        return parsed
    if backend in ("postgresql", "postgres") and driver in ("", "psycopg"):
        return parsed.set(drivername=POSTGRES_DRIVER)
    if backend in ("postgresql", "postgres"):
        raise StoreURLError(f"store.url {redact(url)!r}: driver {driver!r} is not supported; the run store talks to "
                            f"PostgreSQL through psycopg 3: {POSTGRES_DRIVER}://USER@HOST:PORT/DB")
    raise StoreURLError(f"store.url {redact(url)!r}: backend {backend!r} is not supported; the run store runs on "
                        f"sqlite (sqlite:///PATH, the default in the run directory) or postgresql "
                        f"({POSTGRES_DRIVER}://USER@HOST:PORT/DB)")


def is_postgres(url: str | URL) -> bool:
    return str(url).startswith(("postgresql", "postgres:"))


def redact(url: str | URL) -> str:
    """The URL with any password hidden: it goes into error messages and logs."""
    try:
        return (url if isinstance(url, URL) else make_url(url)).render_as_string(hide_password=True)
    except ArgumentError:
        return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", str(url))


def describe(url: str | URL) -> str:
    """How messages name a store: SQLite's file (its URL where it names none); PostgreSQL's server and
    database without password, and the run's schema ("postgresql+psycopg://u@db:5432/tiderl, schema run_x")."""
    if not is_postgres(url):
        return sqlite_file(str(url)) or str(url)
    parsed = make_url(url) if not isinstance(url, URL) else url
    schema = schema_of(parsed)
    plain = parsed.set(query={}).render_as_string(hide_password=True)
    return f"{plain}, schema {schema}" if schema else plain


def sqlite_file(url: str) -> str | None:
    """The file a SQLite URL names: `sqlite:///PATH`, or a URI filename `sqlite:///file:PATH?mode=ro&...`
    (the read-only opening); None for an in-memory database or another backend."""
    if not url.startswith("sqlite:///"):
        return None
    rest = url.removeprefix("sqlite:///")
    if rest.startswith("file:"):
        rest = urllib.parse.unquote(rest.removeprefix("file:").partition("?")[0])
    return rest or None


def run_schema(run_dir: Path) -> str:
    """The PostgreSQL schema of the run in `run_dir`: readable (the directory's name) and unique (a hash of
    its absolute path: two `runs_dir` may hold runs of one name). At most 63 characters, PostgreSQL's limit."""
    path = Path(run_dir).resolve()
    stem = re.sub(r"[^a-z0-9_]+", "_", path.name.lower()).strip("_")[:45] or "run"
    return f"run_{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"


def _options(url: URL) -> str:
    options = url.query.get("options", "")
    return " ".join(options) if isinstance(options, tuple) else options


def schema_of(url: str | URL) -> str | None:
    """The schema a PostgreSQL store URL selects (`options=-csearch_path=...`), or None."""
    found = re.search(r"-c\s*search_path=([A-Za-z0-9_]+)", _options(make_url(url)))
    return found.group(1) if found else None


def with_server_options(url: URL, **settings: str) -> URL:
    """`url` with server settings added to libpq's `options` (`-cNAME=VALUE`), keeping the user's own."""
    options = _options(url)
    extra = " ".join(f"-c{name}={value}" for name, value in settings.items())
    return url.update_query_dict({"options": f"{options} {extra}".strip()})


def store_url(run_dir: Path, configured: str | None, *, read_only: bool = False) -> str:
    """The URL of the store of the run in `run_dir`: the one recorded there at creation, else the
    configured one (PostgreSQL: in the run's own schema), else SQLite's `RUN_DIR/run.db`."""
    pointer = Path(run_dir) / POINTER_FILE
    if pointer.is_file():
        url = pointer.read_text().strip()
    elif configured:
        parsed = parse_store_url(configured)
        if not is_postgres(parsed):
            return configured
        if schema_of(parsed) is None:  # a schema the user chose (options=-csearch_path=NAME) stays theirs
            parsed = with_server_options(parsed, search_path=run_schema(Path(run_dir)))
        url = parsed.render_as_string(hide_password=False)
    else:
        return f"sqlite:///{Path(run_dir) / 'run.db'}"
    if read_only and is_postgres(url):
        # The commands that only look (status, report) cannot change a store they open this way.
        url = with_server_options(make_url(url), default_transaction_read_only="on").render_as_string(
            hide_password=False)
    return url
