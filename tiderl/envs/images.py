"""Images in observations: the PNG format the env protocol carries, checked without trusting it.

Pure: the standard library only (zlib, struct), so the server, the client and the tests share
one definition, and an image is checked without an image library.

An environment whose observations carry pictures is an `ImageEnvironment`: besides the text
observation that `reset` and `step` return as usual, `observation_images()` gives the PNG
images that go with it (shown to the agent before the text). Text-only code keeps working on
such an environment: it sees the text.

`check_png` reads a PNG as an attacker might have written it and names the first thing wrong:
the signature, a chunk cut short or with a wrong CRC, the header (sizes, bit depth, colour type),
more pixels than `ImageLimits.max_pixels` (checked from the header, before any
decompression), missing or misplaced chunks, and image data that does not inflate to exactly
the size the header implies (bounded: a compression bomb is stopped at that size).
"""

from __future__ import annotations

import struct
import zlib
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

from tiderl.envs.base import Environment

MEDIA_TYPE = "image/png"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# colour type -> (channels, allowed bit depths)
_COLOR_TYPES: dict[int, tuple[int, tuple[int, ...]]] = {
    0: (1, (1, 2, 4, 8, 16)),  # grey
    2: (3, (8, 16)),  # RGB
    3: (1, (1, 2, 4, 8)),  # palette
    4: (2, (8, 16)),  # grey + alpha
    6: (4, (8, 16)),  # RGBA
}
_CRITICAL = frozenset({b"IHDR", b"PLTE", b"IDAT", b"IEND"})
# Adam7 passes: (x0, y0, dx, dy)
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


class ImageError(ValueError):
    """An image that is not a valid PNG within the limits; the message says what is wrong."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ImageLimits:
    """What one observation may carry. A GUI screenshot (2560x1600, a few hundred KB as PNG)
    fits the defaults."""

    max_images: int = 8
    """Images per observation."""
    max_bytes: int = 4 << 20
    """Bytes of one PNG file (before base64)."""
    max_pixels: int = 2048 * 2048
    """Width times height of one image."""

    def __post_init__(self) -> None:
        for name in ("max_images", "max_bytes", "max_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class PngImage:
    """A checked PNG file and its size in pixels."""

    data: bytes
    width: int
    height: int

    @property
    def num_pixels(self) -> int:
        return self.width * self.height

    def to_pil(self) -> Any:
        """The picture as an RGB PIL image (what an engine's image processor takes)."""
        import io

        from PIL import Image

        with Image.open(io.BytesIO(self.data)) as picture:
            return picture.convert("RGB")


class ImageEnvironment(Environment):
    """An environment whose observations carry images as well as text."""

    @abstractmethod
    def observation_images(self) -> list[bytes]:
        """The PNG files of the observation `reset` or `step` returned last, in the order the
        agent sees them (before the observation's text); [] for an observation without one."""


def _raw_size(width: int, height: int, bits_per_pixel: int, interlaced: bool) -> list[tuple[int, int]]:
    """(rows, bytes per row including the filter byte) of each pass of the image data."""
    passes = _ADAM7 if interlaced else ((0, 0, 1, 1),)
    out = []
    for x0, y0, dx, dy in passes:
        pass_width = (width - x0 + dx - 1) // dx if width > x0 else 0
        pass_height = (height - y0 + dy - 1) // dy if height > y0 else 0
        if pass_width and pass_height:
            out.append((pass_height, 1 + (pass_width * bits_per_pixel + 7) // 8))
    return out


def check_png(data: bytes, limits: ImageLimits = ImageLimits()) -> PngImage:
    """`data` as a checked `PngImage`, or `ImageError` naming what is wrong with it."""
    if len(data) > limits.max_bytes:
        raise ImageError(f"{len(data)} bytes, more than max_bytes={limits.max_bytes}")
    if not data.startswith(PNG_SIGNATURE):
        raise ImageError(f"not a PNG file (starts with {data[:8]!r}, want the PNG signature)")
    pos = len(PNG_SIGNATURE)
    header: tuple[int, int, int, int, int] | None = None
    has_palette = False
    idat: list[bytes] = []
    idat_done = False
    while True:
        if pos + 8 > len(data):
            raise ImageError(f"cut short: no IEND chunk (file ends at byte {len(data)})")
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if length > len(data) - pos - 12:
            raise ImageError(f"chunk {kind!r} at byte {pos}: {length} data bytes, the file ends before them")
        body = data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        if zlib.crc32(kind + body) != crc:
            raise ImageError(f"chunk {kind!r} at byte {pos}: CRC mismatch (damaged file)")
        if header is None and kind != b"IHDR":
            raise ImageError(f"first chunk is {kind!r}, want IHDR")
        if kind == b"IHDR":
            if header is not None:
                raise ImageError("a second IHDR chunk")
            header = _read_header(body, limits)
        elif kind == b"PLTE":
            has_palette = True
        elif kind == b"IDAT":
            if idat_done:
                raise ImageError("IDAT chunks are not consecutive")
            idat.append(body)
        elif kind == b"IEND":
            break
        elif kind not in _CRITICAL and kind[:1].isupper():
            raise ImageError(f"unknown critical chunk {kind!r}")
        if idat and kind != b"IDAT":
            idat_done = True
        pos += 12 + length
    assert header is not None  # IEND cannot come first: the first chunk must be IHDR
    width, height, bit_depth, color_type, interlace = header
    if color_type == 3 and not has_palette:
        raise ImageError("palette image (colour type 3) without a PLTE chunk")
    if not idat:
        raise ImageError("no image data (IDAT chunk)")
    passes = _raw_size(width, height, _COLOR_TYPES[color_type][0] * bit_depth, interlace == 1)
    _check_image_data(b"".join(idat), passes)
    return PngImage(data, width, height)


def _read_header(body: bytes, limits: ImageLimits) -> tuple[int, int, int, int, int]:
    if len(body) != 13:
        raise ImageError(f"IHDR chunk holds {len(body)} bytes, want 13")
    width, height, bit_depth, color_type, compression, filter_method, interlace = struct.unpack(">IIBBBBB", body)
    if not (0 < width < 1 << 31 and 0 < height < 1 << 31):
        raise ImageError(f"size {width}x{height}: width and height must be positive")
    if width * height > limits.max_pixels:
        raise ImageError(f"size {width}x{height} is {width * height} pixels, more than max_pixels={limits.max_pixels}")
    if color_type not in _COLOR_TYPES:
        raise ImageError(f"colour type {color_type} is not one of {sorted(_COLOR_TYPES)}")
    if bit_depth not in _COLOR_TYPES[color_type][1]:
        raise ImageError(f"bit depth {bit_depth} is not allowed with colour type {color_type} "
                         f"(allowed: {_COLOR_TYPES[color_type][1]})")
    if compression != 0 or filter_method != 0 or interlace not in (0, 1):
        raise ImageError(f"compression {compression}, filter method {filter_method}, interlace {interlace}: "
                         "want 0, 0 and 0 or 1")
    return width, height, bit_depth, color_type, interlace


def _check_image_data(compressed: bytes, passes: list[tuple[int, int]]) -> None:
    """The image data inflates to exactly the rows the header implies, each with a valid filter byte."""
    expected = sum(rows * row_bytes for rows, row_bytes in passes)
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(compressed, expected + 1)
    except zlib.error as e:
        raise ImageError(f"image data does not inflate: {e}") from e
    if len(raw) > expected or inflater.unconsumed_tail:
        raise ImageError(f"image data inflates to more than the {expected} bytes the header implies")
    if len(raw) < expected or not inflater.eof:
        raise ImageError(f"image data inflates to {len(raw)} bytes, the header implies {expected}")
    offset = 0
    for rows, row_bytes in passes:
        for row in range(rows):
            if raw[offset] > 4:
                raise ImageError(f"row {row}: filter type {raw[offset]}, want 0-4")
            offset += row_bytes


def encode_png(width: int, height: int, rgb: bytes) -> bytes:
    """An 8-bit RGB PNG of `rgb` (row-major, 3 bytes a pixel). Deterministic: the same pixels
    always give the same bytes."""
    if len(rgb) != width * height * 3:
        raise ValueError(f"rgb: {len(rgb)} bytes, want {width} * {height} * 3 = {width * height * 3}")
    stride = width * 3
    raw = b"".join(b"\x00" + rgb[y * stride:(y + 1) * stride] for y in range(height))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return PNG_SIGNATURE + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
