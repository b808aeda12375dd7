"""How a weights version travels: tensors packed into byte buckets, each with a CRC32 of its bytes.

The sender packs a version's tensors (in the engine's dtype) into buckets of about
:data:`BUCKET_BYTES` (a tensor larger than that is a bucket of its own) and computes each bucket's
digest while packing; the receiver checks each bucket against it as it arrives, so nothing reads the
whole version again. The layout (names, dtypes, shapes, offsets) travels ahead of the data as JSON;
:func:`version_digest` names a whole version by its layout and bucket digests.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

BUCKET_BYTES = 256 << 20
HELLO = struct.Struct("!Q")  # the first bytes of an engine's data connection: its client id


class TransferError(RuntimeError):
    """A version could not be moved: no server, no such version, a dead peer, a damaged bucket."""


@dataclass(frozen=True, slots=True)
class Slot:
    name: str
    dtype: str  # torch dtype name without the "torch." prefix
    shape: tuple[int, ...]
    offset: int  # bytes into its bucket
    nbytes: int


@dataclass(frozen=True, slots=True)
class BucketLayout:
    nbytes: int
    crc32: int
    slots: tuple[Slot, ...]

    def to_json(self) -> dict:
        return {"nbytes": self.nbytes, "crc32": self.crc32,
                "slots": [[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in self.slots]}

    @staticmethod
    def from_json(d: dict) -> BucketLayout:
        return BucketLayout(int(d["nbytes"]), int(d["crc32"]),
                            tuple(Slot(n, dt, tuple(int(x) for x in sh), int(o), int(nb)) for n, dt, sh, o, nb in d["slots"]))


@dataclass(frozen=True, slots=True)
class Bucket:
    data: torch.Tensor  # uint8, contiguous, on the host
    layout: BucketLayout


def crc32(data: torch.Tensor) -> int:
    """CRC32 of a host uint8 tensor's bytes (zlib releases the GIL over large buffers)."""
    return zlib.crc32(memoryview(data.numpy()))


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TransferError(f"unknown dtype {name!r} in a weights layout")
    return dtype


Alloc = Callable[[int, int], torch.Tensor]  # (bucket index, bytes) -> a uint8 host buffer of that size


def pack(tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None,
         bucket_bytes: int = BUCKET_BYTES, alloc: Alloc | None = None) -> list[Bucket]:
    """The tensors in buckets of about `bucket_bytes`, floating-point ones cast to `dtype` (None: as
    they are), in the order given. Each bucket is a fresh host buffer (from `alloc`, else process memory)
    with its CRC32, computed on a thread while the next bucket is packed."""
    with ThreadPoolExecutor(max_workers=workers()) as pool:
        packed = [(data, slots, pool.submit(crc32, data))
                  for data, slots in _packed(tensors, dtype, bucket_bytes, alloc)]
        return [Bucket(data, BucketLayout(data.numel(), crc.result(), slots)) for data, slots, crc in packed]


def workers() -> int:
    """Threads for CRC passes (zlib releases the GIL: they run in parallel)."""
    return max(1, min(8, os.cpu_count() or 1))


def _packed(tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None, bucket_bytes: int,
            alloc: Alloc | None) -> Iterator[tuple[torch.Tensor, tuple[Slot, ...]]]:
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0
    index = 0

    def flush() -> tuple[torch.Tensor, tuple[Slot, ...]]:
        nonlocal index
        data = alloc(index, size) if alloc is not None else torch.empty(size, dtype=torch.uint8)
        index += 1
        slots, offset = [], 0
        for name, t in pending:
            n = t.numel() * t.element_size()
            if n:
                data[offset:offset + n].copy_(t.reshape(-1).view(torch.uint8))
            slots.append(Slot(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, n))
            offset += n
        return data, tuple(slots)

    for name, tensor in tensors:
        t = tensor.detach()
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        t = t.to("cpu").contiguous()
        n = t.numel() * t.element_size()
        if pending and size + n > bucket_bytes:
            yield flush()
            pending, size = [], 0
        pending.append((name, t))
        size += n
    if pending:
        yield flush()


def check(data: torch.Tensor, layout: BucketLayout) -> None:
    """Raise TransferError where a received bucket is not the one its layout describes."""
    if data.numel() != layout.nbytes:
        raise TransferError(f"a bucket of {data.numel()} bytes, its layout says {layout.nbytes}")
    got = crc32(data)
    if got != layout.crc32:
        raise TransferError(f"a bucket of {layout.nbytes} bytes ({layout.slots[0].name}...) does not match "
                            f"its CRC32 ({got:08x}, sent {layout.crc32:08x})")


def unpack(data: torch.Tensor, layout: BucketLayout, *, checked: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a received bucket (views into `data`), its CRC32 checked first unless `checked`."""
    if not checked:
        check(data, layout)
    out = []
    for s in layout.slots:
        chunk = data[s.offset:s.offset + s.nbytes]
        out.append((s.name, chunk.view(_dtype(s.dtype)).reshape(s.shape)))
    return out


def version_digest(layouts: Iterable[BucketLayout]) -> str:
    """One name for a whole version: SHA256 of its layout and its buckets' CRC32s."""
    text = json.dumps([b.to_json() for b in layouts], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def recv_into(sock: socket.socket, data: torch.Tensor) -> None:
    """Fill a host uint8 tensor from `sock` (its timeout applies to each read); ConnectionError where the
    peer closes first."""
    view = memoryview(data.numpy()).cast("B")
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], min(len(view) - got, 64 << 20))
        if n == 0:
            raise ConnectionError(f"the connection closed after {got} of {len(view)} bytes")
        got += n
