"""Token arrays <-> compact BLOBs (little-endian int32 / float32 / uint8)."""

from __future__ import annotations

import array
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
