"""Images in the env protocol, pure: `images.check_png` and `protocol.parse_images` / `encode_images`
accept valid PNGs within the limits and name what is wrong with anything else."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import pytest
from PIL import Image

from tiderl.envs.images import ImageError, ImageLimits, check_png, encode_png
from tiderl.envs.protocol import encode_images, parse_images

LIMITS = ImageLimits(max_images=3, max_bytes=64 << 10, max_pixels=128 * 128)


def chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_of(width: int, height: int, raw: bytes, *, color_type: int = 2, bit_depth: int = 8,
           interlace: int = 0, extra: bytes = b"") -> bytes:
    header = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, interlace)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + extra + chunk(b"IDAT", zlib.compress(raw))
            + chunk(b"IEND", b""))


def pil_png(mode: str, size: tuple[int, int] = (20, 12), **save: object) -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, color=1 if mode in ("P", "1", "L") else None).save(out, format="PNG", **save)
    return out.getvalue()


def red(width: int, height: int) -> bytes:
    return encode_png(width, height, bytes((200, 10, 10)) * width * height)


def as_field(*pngs: bytes) -> list[dict[str, str]]:
    return [{"media_type": "image/png", "data": base64.b64encode(p).decode()} for p in pngs]


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "P", "1", "I;16"])
def test_pngs_written_by_pil_are_accepted_with_their_size(mode: str) -> None:
    image = check_png(pil_png(mode), LIMITS)
    assert (image.width, image.height) == (20, 12)


def test_encode_png_is_valid_deterministic_and_reads_back_in_pil() -> None:
    pixels = bytes(range(256)) * 36  # 64 x 48 pixels of 3 bytes
    png = encode_png(64, 48, pixels)
    assert png == encode_png(64, 48, pixels)
    assert check_png(png, LIMITS).num_pixels == 64 * 48
    decoded = Image.open(io.BytesIO(png))
    assert decoded.size == (64, 48) and decoded.tobytes() == pixels
    with pytest.raises(ValueError, match="want 64"):
        encode_png(64, 48, pixels[:-1])


def test_interlaced_images_are_checked_with_their_seven_passes() -> None:
    # Adam7 on 3x3 RGB: passes 1, 4, 5, 6 and 7 are non-empty.
    passes = [(1, 1), (1, 1), (1, 2), (2, 1), (1, 3)]  # (rows, pixels per row)
    raw = b"".join(b"\x00" + b"\x07" * 3 * w for rows, w in passes for _ in range(rows))
    assert check_png(png_of(3, 3, raw, interlace=1), LIMITS).width == 3
    with pytest.raises(ImageError, match="inflates to"):
        check_png(png_of(3, 3, raw[:-1], interlace=1), LIMITS)


@pytest.mark.parametrize("make, words", [
    (lambda: b"GIF89a" + b"\x00" * 40, "not a PNG file"),
    (lambda: red(8, 8)[:-20], "cut short|the file ends"),
    (lambda: red(8, 8)[:33] + b"\x00" * 4 + red(8, 8)[37:], "CRC mismatch"),
    (lambda: red(200, 200), "more than max_pixels=16384"),
    (lambda: b"\x00" * 70_000, "more than max_bytes=65536"),
    (lambda: png_of(0, 5, b""), "must be positive"),
    (lambda: png_of(4, 4, b"\x00" * 52, color_type=5), "colour type 5"),
    (lambda: png_of(4, 4, b"\x00" * 52, bit_depth=4), "bit depth 4"),
    (lambda: png_of(4, 4, b"\x00" * 20, color_type=3), "without a PLTE"),
    (lambda: png_of(4, 4, b"\x00" * 51), "inflates to 51 bytes"),
    (lambda: png_of(4, 4, b"\x00" * 5000), "inflates to more"),
    (lambda: png_of(2, 1, b"\x09" + b"\x00" * 6), "filter type 9"),
    (lambda: png_of(4, 4, b"\x00" * 52, extra=chunk(b"ABCD", b"")), "unknown critical chunk"),
    (lambda: b"\x89PNG\r\n\x1a\n" + chunk(b"IDAT", b"x") + chunk(b"IEND", b""), "first chunk"),
    (lambda: red(4, 4).replace(b"IEND", b"IENX").rsplit(b"IENX", 1)[0], "cut short"),
])
def test_a_bad_png_is_named(make, words: str) -> None:
    with pytest.raises(ImageError, match=words):
        check_png(make(), LIMITS)


def test_a_compression_bomb_is_stopped_at_the_size_the_header_implies() -> None:
    bomb = png_of(16, 16, b"\x00" * (50 << 20))  # 50 MB of zeros behind a 16x16 header
    assert len(bomb) < 100 << 10
    with pytest.raises(ImageError, match="more than the 784 bytes"):
        check_png(bomb, ImageLimits(max_bytes=1 << 20))


def test_the_pixel_limit_is_checked_before_any_decompression() -> None:
    # A header claiming 100000 x 100000 pixels with image data that is not even zlib.
    header = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    fake = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"junk") + chunk(b"IEND", b"")
    with pytest.raises(ImageError, match="100000x100000 is 10000000000 pixels"):
        check_png(fake, LIMITS)


def test_parse_images_round_trips_encode_images() -> None:
    pngs = [red(8, 8), encode_png(28, 14, bytes(28 * 14 * 3))]
    images = parse_images(encode_images(pngs, LIMITS), LIMITS)
    assert [(i.width, i.height, i.data) for i in images] == [(8, 8, pngs[0]), (28, 14, pngs[1])]
    assert parse_images([], LIMITS) == ()


@pytest.mark.parametrize("field, words", [
    ({"media_type": "image/png"}, "want a list of images, got dict"),
    (as_field(*[red(2, 2)] * 4), "4 images in one observation, more than max_images=3"),
    (["abc"], r"images\[0\]: want an object, got str"),
    ([{"media_type": "image/png", "data": "", "alt": "x"}], r"images\[0\]: unknown field\(s\) \['alt'\]"),
    ([{"media_type": "image/jpeg", "data": ""}], r"images\[0\]: media_type 'image/jpeg', want 'image/png'"),
    ([{"media_type": "image/png", "data": 7}], r"images\[0\]: data must be a base64 string, got int"),
    ([{"media_type": "image/png", "data": "iVBO!!!="}], r"images\[0\]: data is not base64"),
    ([{"media_type": "image/png", "data": "é"}], r"images\[0\]: data is not base64"),
    ([{"media_type": "image/png", "data": "A" * 90_000}], r"images\[0\]: 90000 base64 characters"),
    (as_field(red(2, 2), red(2, 2)[:-12]), r"images\[1\]: cut short"),
    (as_field(red(200, 100)), r"images\[0\]: size 200x100 is 20000 pixels, more than max_pixels=16384"),
])
def test_a_bad_images_field_names_the_image_and_the_fault(field: object, words: str) -> None:
    with pytest.raises(ImageError, match=words):
        parse_images(field, LIMITS)


def test_encode_images_refuses_what_it_could_not_send() -> None:
    with pytest.raises(ImageError, match="4 images in one observation"):
        encode_images([red(2, 2)] * 4, LIMITS)
    with pytest.raises(ImageError, match=r"images\[1\]: want the bytes of a PNG file, got str"):
        encode_images([red(2, 2), "not bytes"], LIMITS)  # type: ignore[list-item]
    with pytest.raises(ImageError, match=r"images\[0\]: not a PNG file"):
        encode_images([b"hello"], LIMITS)


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_pixels"):
        ImageLimits(max_pixels=0)
