"""The trainer's side of the weight transfer: the newest committed version, served to every engine that asks.

The trainer group's leader stages each version it publishes (:meth:`WeightServer.stage`: the tensors
packed in buckets in the engines' dtype, each bucket's CRC32 computed while packing) and makes it
servable once its version row is committed (:meth:`WeightServer.commit`), so an engine never samples
on weights the store does not know. Engines pull: a rollout rank asks at its own sync boundary, as it
reads files, and gets the newest committed version (never older than the one it asked for; the
server waits a while for a version it has staged but not committed yet).

Transport: a ``torch.distributed`` TCPStore on the leader for the rendezvous and the small messages
(requests, layouts). The buckets are packed into shared-memory files where the host allows
(:mod:`tiderl.weightsync.shm`): an engine on the leader's host maps them and nothing is sent; any other
engine gets them over a TCP connection of its own (the socket's bytes straight from the buckets' memory:
2.5x what gloo's point-to-point sends gave on the development machine's loopback). Each engine worker is served by its own
thread; one that dies mid-transfer costs only its thread (its peer sees a closed connection and falls back
to files).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from tiderl.weightsync.shm import ShmArena
from tiderl.weightsync.wire import BUCKET_BYTES, HELLO, Bucket, pack, version_digest

log = logging.getLogger("tiderl.weightsync")
JOIN_S = 5.0  # how long close waits for each of its threads
IDLE = timedelta(days=7)  # a thread's wait for the next request (woken by close)
CLOSED = "closed"
GREET_S = 15.0  # how long a new data connection may take to name its client, and a client to open it


@dataclass(slots=True)
class Staged:
    version: int
    buckets: list[Bucket]
    digest: str
    paths: list[str] = field(default_factory=list)  # the buckets' shared-memory files; empty: process memory
    header: str = ""
    shm_header: str = ""  # the header with the files' paths, for an engine that can map them
    nbytes: int = 0  # the buckets' (kept once a dropped version's buckets are freed)

    def __post_init__(self) -> None:
        self.nbytes = sum(b.layout.nbytes for b in self.buckets)
        header = {"version": self.version, "digest": self.digest,
                  "buckets": [b.layout.to_json() for b in self.buckets]}
        self.header = json.dumps(header)
        self.shm_header = json.dumps(header | {"shm": self.paths}) if self.paths else ""


@dataclass(slots=True)
class ServerStats:
    versions_served: int = 0
    versions_mapped: int = 0  # of those served, the ones an engine mapped from shared memory (nothing sent)
    bytes_sent: int = 0
    send_s: float = 0.0
    clients: int = 0
    failed: list[str] = field(default_factory=list)


class WeightServer:
    """Stage versions, commit them, serve the newest committed one until :meth:`close`."""

    def __init__(self, host: str | None = None, *, timeout_s: float = 300.0, commit_wait_s: float = 30.0,
                 bucket_bytes: int = BUCKET_BYTES, shared_memory: bool = True) -> None:
        """`shared_memory`: pack versions into shared-memory files where the host has room (engines on this
        host then map them); False: in this process's memory, every engine sent the bytes. The attribute of
        that name decides for each version staged after it is set."""
        self.timeout = timedelta(seconds=timeout_s)
        self.commit_wait_s = commit_wait_s
        self.bucket_bytes = bucket_bytes
        self._store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=self.timeout)
        self.address = f"{host or _reachable_name()}:{self._store.port}"
        self._cond = threading.Condition()
        self._pending: dict[int, Staged] = {}
        self._committed: Staged | None = None
        self.shared_memory = shared_memory
        self._arena = ShmArena()
        self._closed = False
        self._awaited: dict[int, str] = {}  # thread -> the key it blocks on
        self.stats = ServerStats()
        self._threads: list[threading.Thread] = []
        self._conns: dict[int, socket.socket] = {}  # client id -> its data connection
        self._data = socket.create_server(("0.0.0.0", 0), backlog=128)
        self._store.set("data_port", str(self._data.getsockname()[1]))
        self._accept = threading.Thread(target=self._accept_loop, name="weights-accept", daemon=True)
        self._accept.start()
        self._accept_data = threading.Thread(target=self._data_loop, name="weights-data", daemon=True)
        self._accept_data.start()

    # ---- the trainer's side ----------------------------------------------------------------------

    def stage(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
              ) -> Staged:
        """Pack `version` (servable after :meth:`commit`); returns what was staged. A tensor that shares its
        storage with one before it (a tied output layer: the engine loads the embedding) is sent once."""
        buckets, paths = self._pack(version, tensors, dtype)
        staged = Staged(version, buckets, version_digest(b.layout for b in buckets), paths)
        with self._cond:
            dropped = [s for v, s in self._pending.items() if v <= version]
            self._pending = {v: s for v, s in self._pending.items() if v > version} | {version: staged}
            buckets = _take_buckets(dropped)
        self._release(dropped, buckets)
        return staged

    def _pack(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None
              ) -> tuple[list[Bucket], list[str]]:
        arena = self._arena
        if not (self.shared_memory and arena.usable):
            return pack(_distinct(tensors), dtype, self.bucket_bytes), []
        paths: list[str] = []
        room = True

        def alloc(index: int, nbytes: int) -> torch.Tensor:
            nonlocal room
            if room:
                try:
                    data, path = arena.alloc(version, index, nbytes)
                    paths.append(path)
                    return data
                except OSError as e:  # a full tmpfs: this version from process memory, sent to every engine
                    room = False
                    log.warning("weights v%d: no room in shared memory (%s); engines on this host get it sent",
                                version, e)
            return torch.empty(nbytes, dtype=torch.uint8)

        buckets = pack(_distinct(tensors), dtype, self.bucket_bytes, alloc)
        if not room:
            arena.release(paths)  # the buckets already in it stay mapped here, unnamed
            paths = []
        return buckets, paths

    def _release(self, dropped: Iterable[Staged], buckets: list[Bucket]) -> None:
        """Unlink the shared-memory files of versions no longer served (an engine that mapped one keeps it),
        and free their `buckets` (taken out of them, `_take_buckets`) on a thread of their own, one at a
        time: freeing a version's memory takes about 0.2 s per GB here (unmapping its pages), which neither
        the trainer's `commit` nor the next engine's request then waits for (that request did, 0.7-0.9 s
        with 1B fp32 parameters), and each bucket's is short enough for the other threads to go on."""
        for staged in dropped:
            self._arena.release(staged.paths)
        if buckets:
            threading.Thread(target=_free, args=(buckets,), name="weights-free", daemon=True).start()

    def commit(self, version: int) -> None:
        """Serve `version` (staged before) from now on; older versions are dropped."""
        with self._cond:
            staged = self._pending.pop(version, None)
            if staged is None:
                raise KeyError(f"weights v{version} were not staged")
            dropped = staged
            if self._committed is None or self._committed.version < version:
                dropped, self._committed = self._committed, staged
            self._cond.notify_all()
            dropped_list = [dropped] if dropped is not None else []
            buckets = _take_buckets(dropped_list)
        self._release(dropped_list, buckets)

    @property
    def committed_version(self) -> int | None:
        with self._cond:
            return None if self._committed is None else self._committed.version

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._committed = None
            self._pending.clear()
            self._cond.notify_all()
            awaited = list(self._awaited.values())
            conns = list(self._conns.values())
        self._arena.release_all()
        for key in awaited:  # wake the threads blocked on their next key
            self._store.set(key, CLOSED)
        for conn in conns:  # and those blocked sending
            _shut(conn)
        _shut(self._data)
        for t in [self._accept, self._accept_data, *self._threads]:
            t.join(timeout=JOIN_S)
        self._store = None  # type: ignore[assignment]  # the listening socket closes: clients see it gone

    # ---- serving ---------------------------------------------------------------------------------

    def _get(self, store: dist.TCPStore, key: str) -> str | None:
        """Block for `key` (each thread has its own connection: a blocking get holds it); None once closed."""
        with self._cond:
            if self._closed:
                return None
            self._awaited[threading.get_ident()] = key
        try:
            value = store.get(key).decode()
        finally:
            with self._cond:
                self._awaited.pop(threading.get_ident(), None)
        return None if self._closed or value == CLOSED else value

    def _connect(self) -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", self._store.port, is_master=False, timeout=IDLE)

    def _accept_loop(self) -> None:
        store = self._connect()
        k = 1
        while self._get(store, f"hello/{k}") is not None:
            t = threading.Thread(target=self._serve, args=(k,), name=f"weights-client{k}", daemon=True)
            t.start()
            self._threads.append(t)
            self.stats.clients += 1
            k += 1

    def _data_loop(self) -> None:
        while True:
            try:
                conn, _ = self._data.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._greet, args=(conn,), name="weights-greet", daemon=True).start()

    def _greet(self, conn: socket.socket) -> None:
        """A data connection names its client first; one that does not, or names a client that has one, is
        closed."""
        try:
            conn.settimeout(GREET_S)
            (k,) = HELLO.unpack(conn.recv(HELLO.size, socket.MSG_WAITALL))
        except (OSError, struct.error):
            _shut(conn)
            return
        with self._cond:
            if self._closed or k in self._conns:
                _shut(conn)
                return
            self._conns[k] = conn
            self._cond.notify_all()

    def _connection(self, k: int) -> socket.socket | None:
        """Client `k`'s data connection, once it has opened it (None after GREET_S, or once closed)."""
        with self._cond:  # woken by _greet and by close
            self._cond.wait_for(lambda: self._closed or k in self._conns, timeout=GREET_S)
            return None if self._closed else self._conns.get(k)

    def _servable(self, min_version: int) -> tuple[Staged, list[Bucket]] | None:
        """The committed version if it is at least `min_version`, waiting up to `commit_wait_s` for the
        commit (a rank may see the boundary a moment before the leader marks the version servable), with
        its buckets (taken under the lock: a version dropped while they are sent keeps them until then)."""

        def ready() -> bool:
            return self._closed or (self._committed is not None and self._committed.version >= min_version)

        with self._cond:  # woken by commit and by close
            self._cond.wait_for(ready, timeout=self.commit_wait_s)
            c = self._committed
            return (c, c.buckets) if not self._closed and c is not None and c.version >= min_version else None

    def _serve(self, k: int) -> None:
        prefix = f"c{k}/"
        store = self._connect()
        conn = self._connection(k)
        if conn is None:  # the engine went away before it opened its data connection
            self.stats.failed.append(f"client {k}: no data connection within {GREET_S:.0f} s")
            log.warning("weights client %d opened no data connection", k)
            return
        conn.settimeout(self.timeout.total_seconds())
        seq = 0
        while True:
            seq += 1
            # The version served last is not held while waiting: it is freed in the background once a newer
            # one is committed (`_release`), not here when this engine's next request comes.
            served = staged = buckets = None
            request = self._get(store, f"{prefix}req/{seq}")
            if request is None:
                return
            try:
                served = self._servable(int(json.loads(request)["min_version"]))
                if served is None:
                    have = self.committed_version
                    store.set(f"{prefix}hdr/{seq}", json.dumps({
                        "error": f"no committed version >= {json.loads(request)['min_version']} to serve "
                                 f"(newest: {have})"}))
                    continue
                staged, buckets = served
                if staged.shm_header and json.loads(request).get("shm"):  # the engine maps the files itself
                    store.set(f"{prefix}hdr/{seq}", staged.shm_header)
                    self.stats.versions_served += 1
                    self.stats.versions_mapped += 1
                    continue
                store.set(f"{prefix}hdr/{seq}", staged.header)
                t0 = time.monotonic()
                for b in buckets:
                    conn.sendall(memoryview(b.data.numpy()).cast("B"))
                self.stats.send_s += time.monotonic() - t0
                self.stats.versions_served += 1
                self.stats.bytes_sent += staged.nbytes
            except Exception as e:  # the engine died or left mid-transfer: only this client is lost
                self.stats.failed.append(f"client {k}: {e}")
                log.warning("weights client %d dropped: %s", k, e)
                _shut(conn)
                return


def _take_buckets(dropped: list[Staged]) -> list[Bucket]:
    """The buckets of versions no longer served, taken out of them (under the server's lock, under which a
    serving thread takes the buckets of the version it serves: `_servable`)."""
    taken: list[Bucket] = []
    for staged in dropped:
        taken += staged.buckets
        staged.buckets = []
    return taken


def _free(buckets: list[Bucket]) -> None:
    """Drop the buckets one by one (those a serving thread is still sending live on until it has sent them)."""
    while buckets:
        buckets.pop()


def _shut(sock: socket.socket) -> None:
    """Close a socket, waking a thread blocked on it."""
    with contextlib.suppress(OSError):  # not connected, or already shut
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def _distinct(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for name, t in tensors:
        key = (t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        yield name, t


def _reachable_name() -> str:
    """This host's name for the engines (other nodes resolve it), or the loopback address where it does not
    resolve even here."""
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
    except OSError:
        log.warning("host name %r does not resolve: the weight server is reachable on this host only", name)
        return "127.0.0.1"
    return name
