"""The environment service protocol: endpoint names, request parsing, error codes.

Pure: no HTTP stack here, so the server and the tests share one definition.

    POST /start        {"env": STR, "seed": INT, "options": {...}}
                       -> {"session_id": STR, "observation": STR, "done": false, "info": {...}}
    POST /observation  {"session_id": STR, "action": STR}
                       -> {"observation": STR, "reward": FLOAT, "done": BOOL, "info": {...}}
    POST /pause        {"session_id": STR} -> {"session_id": STR, "state": "paused"}
    POST /resume       {"session_id": STR} -> {"session_id": STR, "state": "active" | "done"}
    POST /end          {"session_id": STR} -> {"reward": FLOAT, "info": {...}}
    GET  /health       -> {"status": "ok" | "draining", "active": N, "paused": N, ...}

An environment whose observations carry pictures (`images.ImageEnvironment`) answers /start
and /observation with one more field, the observation's images in the order the agent sees
them (before the text):

                       "images": [{"media_type": "image/png", "data": BASE64}, ...]

Each image is a PNG file, base64-encoded (RFC 4648, with padding), within `ImageLimits`
(images per observation, bytes and pixels per image); `parse_images` checks an answer's
field and names the image and what is wrong with it. The server checks the images its
environment produced the same way before answering: a bad one is the environment's failure
(500 `env_error`, naming the image and the fault; the session is ended), never sent on.
Answers of text environments have no `images` field (read as none).

Errors are `{"error": STR, "code": CODE}` with the HTTP status of `ErrorCode`.
A 429 or 503 answer is given before the server changes any state, so a client may
always retry it.

A body is UTF-8 JSON nested at most `MAX_JSON_DEPTH` deep whose strings are valid
Unicode (no lone surrogates); anything else is a 400 naming what was wrong
(`parse_body`).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from tiderl.envs.images import MEDIA_TYPE, ImageError, ImageLimits, PngImage, check_png

PROTOCOL_VERSION = 1
TOKEN_HEADER = "Authorization"  # value: "Bearer TOKEN"
TOKEN_ENV_VAR = "TIDERL_ENV_TOKEN"
MAX_JSON_DEPTH = 64  # nesting of arrays and objects in a request body


class ErrorCode(Enum):
    """Machine-readable error codes and their HTTP status."""

    BAD_REQUEST = ("bad_request", 400)  # malformed JSON, missing or ill-typed field
    BAD_OPTIONS = ("bad_options", 400)  # the environment refused its options
    UNAUTHORIZED = ("unauthorized", 401)
    FORBIDDEN = ("forbidden", 403)  # an option value only the server's operator may allow (pytool's sandbox: unsafe)
    NOT_FOUND = ("not_found", 404)  # no such endpoint
    UNKNOWN_ENV = ("unknown_env", 404)
    UNKNOWN_SESSION = ("unknown_session", 404)
    METHOD_NOT_ALLOWED = ("method_not_allowed", 405)
    REQUEST_TIMEOUT = ("request_timeout", 408)  # headers or body not received in time
    SESSION_PAUSED = ("session_paused", 409)
    SESSION_ENDED = ("session_ended", 409)  # ended by /end, reaped, or failed
    EPISODE_DONE = ("episode_done", 409)  # the episode finished; only /end (or pause) remains
    SESSION_BUSY = ("session_busy", 409)  # /observation or /end while a step is in progress
    TOO_LARGE = ("too_large", 413)
    AT_CAPACITY = ("at_capacity", 429)  # max_sessions sessions are live
    CLIENT_LIMIT = ("client_limit", 429)  # this client holds max_sessions_per_client sessions
    QUEUE_FULL = ("queue_full", 429)  # max_queued_steps env calls already wait for a worker thread
    ENV_ERROR = ("env_error", 500)  # the environment raised; the session is ended
    INTERNAL = ("internal", 500)
    DRAINING = ("draining", 503)  # the server is shutting down
    TOO_MANY_CONNECTIONS = ("too_many_connections", 503)  # max_connections are open

    @property
    def code(self) -> str:
        return self.value[0]

    @property
    def status(self) -> int:
        return self.value[1]


class ProtocolError(Exception):
    """A request the server answers with an error: the code gives the HTTP status."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code.status} {code.code}: {message}")

    def to_json(self) -> dict[str, Any]:
        return {"error": self.message, "code": self.code.code}


def _bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, message)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_text(text: str, endpoint: str, where: str) -> None:
    bad = _SURROGATE.search(text)
    if bad is not None:
        raise _bad(
            f"{endpoint}: {where} holds a lone surrogate ({ascii(bad.group())[1:-1]} at character {bad.start()}); "
            "text must be valid Unicode"
        )


def parse_body(raw: bytes, endpoint: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON value of a request body, or a 400 naming what is wrong with it: not UTF-8,
    not JSON (NaN and Infinity included), nested deeper than `max_depth`, or a string with
    a lone surrogate (an escape like "\\ud800", which no environment could encode)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _bad(f"{endpoint}: body is not UTF-8 (byte 0x{raw[e.start]:02x} at position {e.start})") from e
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError as e:  # the decoder's own depth limit, far above ours
        raise _bad(f"{endpoint}: body is nested deeper than {max_depth} levels") from e
    except ValueError as e:  # JSONDecodeError, NaN, an integer over Python's digit limit
        raise _bad(f"{endpoint}: body is not valid JSON: {e}") from e
    # Walk with an explicit stack: depth and text are checked without recursion.
    stack: list[tuple[Any, str, int]] = [(value, "body", 0)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item, endpoint, where)
        elif isinstance(item, (dict, list)):
            if depth >= max_depth:
                raise _bad(f"{endpoint}: body is nested deeper than {max_depth} levels")
            if isinstance(item, dict):
                for key, child in item.items():
                    _check_text(key, endpoint, f"a key of {where}")
                    name = f"field {key!r}" if depth == 0 else f"{where}[{key!r}]"
                    stack.append((child, name, depth + 1))
            else:
                stack.extend((child, f"{where}[{i}]", depth + 1) for i, child in enumerate(item))
    return value


def describe_non_ascii(name: str, value: str) -> str | None:
    """None if a header value is ASCII, else what is wrong with it. The HTTP parser hands
    bytes that are not UTF-8 over as surrogate escapes; they are turned back into bytes here."""
    if value.isascii():
        return None
    raw = value.encode("utf-8", "surrogateescape")
    at = next(i for i, byte in enumerate(raw) if byte >= 0x80)
    return f"the {name} header is not ASCII (byte 0x{raw[at]:02x} at position {at})"


@dataclass(frozen=True)
class StartRequest:
    env: str
    seed: int
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepRequest:
    session_id: str
    action: str


def _require_object(body: Any, endpoint: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{endpoint}: body must be a JSON object, got {type(body).__name__}")
    return body


def _field(body: dict[str, Any], endpoint: str, name: str, tp: type, *, required: bool = True) -> Any:
    if name not in body:
        if required:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{endpoint}: missing field {name!r}")
        return None
    value = body[name]
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"{endpoint}: field {name!r} must be {_TYPE_NAMES[tp]}, got {type(value).__name__}",
        )
    return value


_TYPE_NAMES = {str: "a string", int: "an integer", dict: "an object"}


def _check_fields(body: dict[str, Any], endpoint: str, known: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"{endpoint}: unknown field(s) {unknown} (known: {list(known)})"
        )


def parse_start(body: Any) -> StartRequest:
    body = _require_object(body, "/start")
    _check_fields(body, "/start", ("env", "seed", "options"))
    env = _field(body, "/start", "env", str)
    seed = _field(body, "/start", "seed", int)
    options = _field(body, "/start", "options", dict, required=False)
    return StartRequest(env=env, seed=seed, options=options or {})


def parse_step(body: Any) -> StepRequest:
    body = _require_object(body, "/observation")
    _check_fields(body, "/observation", ("session_id", "action"))
    return StepRequest(
        session_id=_field(body, "/observation", "session_id", str),
        action=_field(body, "/observation", "action", str),
    )


def parse_session_id(body: Any, endpoint: str) -> str:
    body = _require_object(body, endpoint)
    _check_fields(body, endpoint, ("session_id",))
    return _field(body, endpoint, "session_id", str)


_IMAGE_FIELDS = ("media_type", "data")


def encode_images(pngs: Sequence[bytes], limits: ImageLimits) -> list[dict[str, str]]:
    """The `images` field of an answer for an environment's PNG files, each checked first:
    `ImageError` naming the image and what is wrong with it."""
    if len(pngs) > limits.max_images:
        raise ImageError(f"{len(pngs)} images in one observation, more than max_images={limits.max_images}")
    out = []
    for i, png in enumerate(pngs):
        if not isinstance(png, (bytes, bytearray)):
            raise ImageError(f"images[{i}]: want the bytes of a PNG file, got {type(png).__name__}")
        try:
            check_png(bytes(png), limits)
        except ImageError as e:
            raise ImageError(f"images[{i}]: {e}") from e
        out.append({"media_type": MEDIA_TYPE, "data": base64.b64encode(png).decode("ascii")})
    return out


def parse_images(value: Any, limits: ImageLimits) -> tuple[PngImage, ...]:
    """The checked images of an answer's `images` field; `ImageError` naming the image and what
    is wrong: not a list, too many, an item that is not {"media_type": "image/png", "data": STR},
    data that is not base64, too large before or after decoding, or not a valid PNG within the
    pixel limit (`images.check_png`)."""
    if not isinstance(value, list):
        raise ImageError(f"want a list of images, got {type(value).__name__}")
    if len(value) > limits.max_images:
        raise ImageError(f"{len(value)} images in one observation, more than max_images={limits.max_images}")
    max_encoded = 4 * ((limits.max_bytes + 2) // 3)
    images = []
    for i, item in enumerate(value):
        where = f"images[{i}]"
        if not isinstance(item, dict):
            raise ImageError(f"{where}: want an object, got {type(item).__name__}")
        unknown = sorted(set(item) - set(_IMAGE_FIELDS))
        if unknown:
            raise ImageError(f"{where}: unknown field(s) {unknown} (known: {list(_IMAGE_FIELDS)})")
        if item.get("media_type") != MEDIA_TYPE:
            raise ImageError(f"{where}: media_type {item.get('media_type')!r}, want {MEDIA_TYPE!r}")
        data = item.get("data")
        if not isinstance(data, str):
            raise ImageError(f"{where}: data must be a base64 string, got {type(data).__name__}")
        if len(data) > max_encoded:  # refused before decoding
            raise ImageError(f"{where}: {len(data)} base64 characters, more than max_bytes={limits.max_bytes} "
                             "bytes encode to")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageError(f"{where}: data is not base64: {e}") from e
        try:
            images.append(check_png(raw, limits))
        except ImageError as e:
            raise ImageError(f"{where}: {e}") from e
    return tuple(images)
