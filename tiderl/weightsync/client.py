"""An engine's side of the weight transfer: ask the trainer's :class:`~tiderl.weightsync.server.WeightServer`
for a version and receive it whole, every bucket checked against its CRC32 as it arrives.

Nothing is handed to the model before the whole version is here and checked, so a transfer that fails
(the server gone, a dead connection, a damaged bucket) leaves the engine's weights as they were.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tiderl.weightsync.wire import BucketLayout, TransferError, check, unpack, version_digest


@dataclass(frozen=True, slots=True)
class Received:
    version: int
    tensors: list[tuple[str, torch.Tensor]]
    digest: str
    nbytes: int
    seconds: float


class WeightClient:
    """One connection to a weight server (`address` ``host:port``), kept for every later version."""

    def __init__(self, address: str, *, timeout_s: float = 300.0, connect_timeout_s: float = 15.0,
                 header_timeout_s: float = 60.0) -> None:
        """`connect_timeout_s` bounds everything before the data group exists (a server that hangs costs no
        more), `header_timeout_s` each wait for a version's layout (the server waits up to its commit_wait_s),
        `timeout_s` the buckets."""
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise TransferError(f"weight server address {address!r} is not host:port")
        self.address = address
        timeout = timedelta(seconds=timeout_s)
        try:
            self._store = _connect(host, int(port), timedelta(seconds=min(timeout_s, connect_timeout_s)))
            self.id = self._store.add("clients", 1)
            self._store.set(f"hello/{self.id}", "1")
            prefix = f"c{self.id}/"
            self._pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix + "pg/", self._store), 1, 2, timeout)
        except (RuntimeError, OSError) as e:  # torch's store and gloo errors are RuntimeErrors
            raise TransferError(f"cannot reach the weight server at {address}: {e}") from e
        self._store.set_timeout(timedelta(seconds=header_timeout_s))
        self._prefix = prefix
        self._seq = 0

    def receive(self, min_version: int, expected: Collection[str] = ()) -> Received:
        """The server's newest committed version (at least `min_version`), every bucket checked. Raises
        TransferError where none can be had or a tensor of `expected` is not in it."""
        self._seq += 1
        t0 = time.monotonic()
        try:
            self._store.set(f"{self._prefix}req/{self._seq}", json.dumps({"min_version": min_version}))
            header = json.loads(self._store.get(f"{self._prefix}hdr/{self._seq}"))
        except (RuntimeError, OSError) as e:
            raise TransferError(f"weight server {self.address}: {e}") from e
        if "error" in header:
            raise TransferError(f"weight server {self.address}: {header['error']}")
        layouts = [BucketLayout.from_json(b) for b in header["buckets"]]
        tensors: list[tuple[str, torch.Tensor]] = []
        with ThreadPoolExecutor(max_workers=1) as checker:  # bucket i checked while i + 1 arrives
            checks = []
            for i, layout in enumerate(layouts):
                data = torch.empty(layout.nbytes, dtype=torch.uint8)
                try:
                    self._pg.recv([data], 0, i).wait()
                except RuntimeError as e:
                    raise TransferError(f"weight server {self.address}: v{header['version']} bucket {i + 1} of "
                                        f"{len(layouts)} not received: {e}") from e
                checks.append(checker.submit(check, data, layout))
                tensors += unpack(data, layout, checked=True)
            for c in checks:
                c.result()  # raises TransferError for a damaged bucket
        digest = version_digest(layouts)
        if digest != header["digest"]:
            raise TransferError(f"weights v{header['version']}: the layout's digest {digest[:12]} is not the "
                                f"one sent ({header['digest'][:12]})")
        names = {n for n, _ in tensors}
        lacking = sorted(set(expected) - names)
        if lacking:
            raise TransferError(f"weights v{header['version']} lack {len(lacking)} of the model's tensors "
                                f"({', '.join(lacking[:5])}{', ...' if len(lacking) > 5 else ''})")
        return Received(int(header["version"]), tensors, digest, sum(b.nbytes for b in layouts),
                        time.monotonic() - t0)

    def close(self) -> None:
        self._pg = None  # type: ignore[assignment]
        self._store = None  # type: ignore[assignment]


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
