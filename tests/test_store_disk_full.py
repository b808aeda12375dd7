"""A full disk under the run store: writes wait and retry (`store.disk_full_wait_s`), then fail clearly."""

from __future__ import annotations

import sqlite3

import pytest
from sqlalchemy import create_engine
from sqlalchemy.exc import OperationalError

from tiderl.store.engine import StoreError, StoreFullError, Transactor


def full() -> OperationalError:
    return OperationalError("INSERT INTO metrics ...", {}, sqlite3.OperationalError("database or disk is full"))


def flaky(fails: int):
    calls = []

    def fn(conn):
        calls.append(1)
        if len(calls) <= fails:
            raise full()
        return "written"

    return fn, calls


def test_a_write_that_finds_the_disk_full_is_retried_until_there_is_room(tmp_path):
    tx = Transactor(create_engine(f"sqlite:///{tmp_path / 'a.db'}"), max_retries=2, label="a.db",
                    full_wait_s=5.0, full_retry_s=0.01)
    fn, calls = flaky(3)
    assert tx.write(fn) == "written" and len(calls) == 4


def test_a_disk_that_stays_full_fails_the_write_naming_the_store(tmp_path):
    tx = Transactor(create_engine(f"sqlite:///{tmp_path / 'a.db'}"), max_retries=2, label="a.db",
                    full_wait_s=0.05, full_retry_s=0.01)
    fn, calls = flaky(10_000)
    with pytest.raises(StoreFullError, match="a.db: the disk is still full") as info:
        tx.write(fn)
    assert isinstance(info.value, StoreError) and len(calls) >= 2
    no_wait = Transactor(create_engine(f"sqlite:///{tmp_path / 'b.db'}"), max_retries=2, label="b.db")
    fn, calls = flaky(1)
    with pytest.raises(StoreFullError):
        no_wait.write(fn)
    assert len(calls) == 1
