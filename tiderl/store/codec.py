"""Token arrays <-> compact BLOBs (little-endian int32 / float32 / uint8), and a list of byte strings
(a trajectory's images) <-> one BLOB (each a little-endian uint32 length, then its bytes)."""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Sequence


def _pack(code: str, values: Sequence[float] | Sequence[int]) -> bytes:
    a = array.array(code, values)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def _unpack(code: str, blob: bytes) -> list:
    a = array.array(code)
    a.frombytes(blob)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def pack_ints(values: Sequence[int]) -> bytes:
    return _pack("i", values)


def unpack_ints(blob: bytes) -> list[int]:
    return _unpack("i", blob)


def pack_floats(values: Sequence[float]) -> bytes:
    return _pack("f", values)


def unpack_floats(blob: bytes) -> list[float]:
    return _unpack("f", blob)


def pack_mask(values: Sequence[int]) -> bytes:
    return bytes(1 if v else 0 for v in values)


def unpack_mask(blob: bytes) -> list[int]:
    return list(blob)


def pack_blobs(blobs: Sequence[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(b)) + bytes(b) for b in blobs)


def unpack_blobs(blob: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(blob):
        if i + 4 > len(blob):
            raise ValueError(f"packed blobs: a length cut short at byte {i} of {len(blob)}")
        (n,) = struct.unpack_from("<I", blob, i)
        if i + 4 + n > len(blob):
            raise ValueError(f"packed blobs: an item of {n} bytes at byte {i} runs past the end ({len(blob)})")
        out.append(blob[i + 4:i + 4 + n])
        i += 4 + n
    return out
