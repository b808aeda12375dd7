"""An engine's side of the weight transfer: ask the trainer's :class:`~tiderl.weightsync.server.WeightServer`
for a version and take it whole, every bucket checked against its CRC32.

An engine on the server's host maps the version's shared-memory files (nothing is sent); any other engine,
or one that cannot open them, receives the buckets over the connection, each checked as it arrives. The
layout (and so whether the version holds every tensor the model needs) is checked before any data, and
a received version is handed to the model only once it is all here and checked, so a transfer that fails
(the server gone, a dead connection, a damaged bucket) leaves the engine's weights as they were. A mapped
version can be handed over bucket by bucket as each passes its check (`check_ahead`: the engine loads
while the later buckets are checked).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tiderl.weightsync.shm import map_bucket
from tiderl.weightsync.wire import HELLO, BucketLayout, TransferError, check, recv_into, unpack, version_digest, workers

MAP_TRIES = 2  # a version's files may be replaced between its header and the mapping: ask once more
MAP_RETRY_S = 30.0  # after files that could not be opened, have versions sent this long before trying again


@dataclass(frozen=True, slots=True)
class Received:
    version: int
    tensors: Iterable[tuple[str, torch.Tensor]]  # a list, or CheckedBuckets (`receive(check_ahead=True)`)
    digest: str
    nbytes: int
    seconds: float
    via: str = "sent"  # or "shared_memory": mapped from the server's files on this host


class WeightClient:
    """One connection to a weight server (`address` ``host:port``), kept for every later version."""

    def __init__(self, address: str, *, timeout_s: float = 300.0, connect_timeout_s: float = 15.0,
                 header_timeout_s: float = 60.0, shared_memory: bool = True) -> None:
        """`connect_timeout_s` bounds everything before the data connection is open (a server that hangs costs no
        more), `header_timeout_s` each wait for a version's layout (the server waits up to its commit_wait_s),
        `timeout_s` the buckets. `shared_memory`: map a version's files where the server offers them (False:
        always have the bytes sent); files that cannot be opened are not tried again for MAP_RETRY_S."""
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise TransferError(f"weight server address {address!r} is not host:port")
        self.address = address
        connect = min(timeout_s, connect_timeout_s)
        try:
            self._store = _connect(host, int(port), timedelta(seconds=connect))
            self.id = self._store.add("clients", 1)
            self._store.set(f"hello/{self.id}", "1")
            prefix = f"c{self.id}/"
            self._sock = socket.create_connection((host, int(self._store.get("data_port"))), timeout=connect)
            self._sock.sendall(HELLO.pack(self.id))
            self._sock.settimeout(timeout_s)
        except (RuntimeError, OSError) as e:  # torch's store errors are RuntimeErrors
            raise TransferError(f"cannot reach the weight server at {address}: {e}") from e
        self._store.set_timeout(timedelta(seconds=header_timeout_s))
        self._prefix = prefix
        self._seq = 0
        self.shared_memory = shared_memory
        self._map_after = 0.0  # monotonic time before which versions are sent (the files could not be opened)

    def receive(self, min_version: int, expected: Collection[str] = (), *, check_ahead: bool = False) -> Received:
        """The server's newest committed version (at least `min_version`), every bucket checked. Raises
        TransferError where none can be had or a tensor of `expected` is not in it. `check_ahead`: a version
        mapped from the server's files comes back before its buckets are checked, as :class:`CheckedBuckets`
        (`tensors`), which gives each bucket's tensors once its check has passed, the later buckets checked
        meanwhile on the other cores, so that the engine loads while they are checked; a damaged bucket then
        raises TransferError while the earlier ones may be loaded already (the caller's engine holds a mix)."""
        t0 = time.monotonic()
        header: dict[str, Any] | None = None
        if self.shared_memory and time.monotonic() >= self._map_after:
            for _ in range(MAP_TRIES):
                header, layouts = self._ask(min_version, shm=True)
                if "shm" not in header:
                    break  # the server holds this version in its own memory: the buckets are on their way
                _check_layout(header, layouts, expected)  # nothing was sent: refused before any data
                mapped = _mapped(header, layouts, check_ahead)
                if mapped is not None:
                    return Received(int(header["version"]), mapped, str(header["digest"]),
                                    sum(b.nbytes for b in layouts), time.monotonic() - t0, "shared_memory")
                header = None  # replaced meanwhile, or not this host's files: ask again
            else:  # twice not openable: another host's (or user's) files, or removed: sent for a while
                self._map_after = time.monotonic() + MAP_RETRY_S
        if header is None:
            header, layouts = self._ask(min_version, shm=False)
        tensors = self._received(header, layouts)
        _check_layout(header, layouts, expected)  # after the buckets, so the connection stays in step
        return Received(int(header["version"]), tensors, str(header["digest"]), sum(b.nbytes for b in layouts),
                        time.monotonic() - t0)

    def _ask(self, min_version: int, *, shm: bool) -> tuple[dict[str, Any], list[BucketLayout]]:
        self._seq += 1
        try:
            self._store.set(f"{self._prefix}req/{self._seq}", json.dumps({"min_version": min_version, "shm": shm}))
            header = json.loads(self._store.get(f"{self._prefix}hdr/{self._seq}"))
        except (RuntimeError, OSError) as e:
            raise TransferError(f"weight server {self.address}: {e}") from e
        if "error" in header:
            raise TransferError(f"weight server {self.address}: {header['error']}")
        return header, [BucketLayout.from_json(b) for b in header["buckets"]]

    def _received(self, header: dict[str, Any], layouts: list[BucketLayout]) -> list[tuple[str, torch.Tensor]]:
        tensors: list[tuple[str, torch.Tensor]] = []
        with ThreadPoolExecutor(max_workers=1) as checker:  # bucket i checked while i + 1 arrives
            checks = []
            for i, layout in enumerate(layouts):
                data = torch.empty(layout.nbytes, dtype=torch.uint8)
                try:
                    recv_into(self._sock, data)
                except OSError as e:  # a timeout, a reset, or closed early (ConnectionError)
                    raise TransferError(f"weight server {self.address}: v{header['version']} bucket {i + 1} of "
                                        f"{len(layouts)} not received: {e}") from e
                checks.append(checker.submit(check, data, layout))
                tensors += unpack(data, layout, checked=True)
            for c in checks:
                c.result()  # raises TransferError for a damaged bucket
        return tensors

    def close(self) -> None:
        self._sock.close()
        self._store = None  # type: ignore[assignment]


def _check_layout(header: dict[str, Any], layouts: list[BucketLayout], expected: Collection[str]) -> None:
    """Raise TransferError where the layouts are not the ones the server named, or lack a tensor of `expected`."""
    digest = version_digest(layouts)
    if digest != header["digest"]:
        raise TransferError(f"weights v{header['version']}: the layout's digest {digest[:12]} is not the "
                            f"one sent ({header['digest'][:12]})")
    lacking = sorted(set(expected) - {s.name for b in layouts for s in b.slots})
    if lacking:
        raise TransferError(f"weights v{header['version']} lack {len(lacking)} of the model's tensors "
                            f"({', '.join(lacking[:5])}{', ...' if len(lacking) > 5 else ''})")


def _mapped(header: dict[str, Any], layouts: list[BucketLayout], check_ahead: bool = False
            ) -> list[tuple[str, torch.Tensor]] | CheckedBuckets | None:
    """The version's tensors mapped from its shared-memory files, every bucket checked (in parallel, on the
    cores of this process's pinned threads: zlib releases the GIL), or None where a file cannot be opened
    here. Raises TransferError for a damaged bucket. `check_ahead`: the buckets as they pass their checks
    (:class:`CheckedBuckets`)."""
    try:
        data = [map_bucket(path, layout.nbytes) for path, layout in zip(header["shm"], layouts, strict=True)]
    except (OSError, RuntimeError, ValueError):
        return None
    if check_ahead:
        return CheckedBuckets(data, layouts)
    cpus = _pinned_cpus()
    with ThreadPoolExecutor(max_workers=max(1, min(workers(), len(cpus))), initializer=_on(cpus)) as pool:
        list(pool.map(check, data, layouts))
    return [kv for d, layout in zip(data, layouts) for kv in unpack(d, layout, checked=True)]


class CheckedBuckets:
    """A mapped version's tensors, bucket by bucket, each given once its CRC32 check has passed. Every check
    is queued at once on threads of their own, on the cores of this process's pinned threads other than the
    caller's (where there are others: the caller loads the tensors meanwhile); iterating raises
    TransferError at the first damaged bucket. :meth:`close` (or the iteration's end) stops the checks."""

    def __init__(self, data: list[torch.Tensor], layouts: list[BucketLayout]) -> None:
        cpus = _pinned_cpus()
        others = cpus - os.sched_getaffinity(0) or cpus
        self._data, self._layouts = data, layouts
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(workers(), len(others))), initializer=_on(others))
        self._checks = [self._pool.submit(check, d, layout) for d, layout in zip(data, layouts)]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        try:
            for d, layout, checked in zip(self._data, self._layouts, self._checks):
                checked.result()  # raises TransferError for a damaged bucket
                yield from unpack(d, layout, checked=True)
        finally:
            self.close()

    def close(self) -> None:
        for c in self._checks:
            c.cancel()
        self._pool.shutdown(wait=True)


def _on(cpus: set[int]) -> Callable[[], None]:
    """A thread initializer: run on any of `cpus` (a new thread inherits its creator's one pinned core)."""

    def spread() -> None:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cpus)

    return spread


def _pinned_cpus() -> set[int]:
    """The cores this thread may run on, with every core one of this process's threads is pinned to (a thread
    allowed a single core) and the cores of its parent process. vLLM's CPU worker pins each of its OpenMP
    threads to a core of its own, its main thread to the first, and a new thread inherits its creator's
    cores: the checking threads this worker starts would all share its main thread's one core. While a
    version is received and loaded the engine steps no batch: its OpenMP threads' cores are idle, and so
    are those its engine core process (the worker's parent) keeps for itself (vLLM's reserved cores)."""
    cpus = set(os.sched_getaffinity(0))
    with contextlib.suppress(OSError):
        cpus |= os.sched_getaffinity(os.getppid())
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return cpus
    for tid in tids:
        try:
            allowed = os.sched_getaffinity(int(tid))
        except (OSError, ValueError):  # ended meanwhile
            continue
        if len(allowed) == 1:
            cpus |= allowed
    return cpus


def _connect(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A TCPStore client, or TransferError within `timeout`: torch's client waits for ever on a listener that
    accepts and never answers (a hung server), so it connects on a thread of its own (left behind if it hangs)."""
    box: dict[str, Any] = {}

    def connect() -> None:
        try:
            box["store"] = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        except (RuntimeError, OSError) as e:
            box["error"] = e

    t = threading.Thread(target=connect, name="weights-connect", daemon=True)
    t.start()
    t.join(timeout.total_seconds() + 1.0)
    if "store" in box:
        return box["store"]
    raise TransferError(str(box.get("error", f"no answer within {timeout.total_seconds():.0f} s")))
