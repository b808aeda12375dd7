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

Errors are `{"error": STR, "code": CODE}` with the HTTP status of `ErrorCode`.
A 429 or 503 answer is given before the server changes any state, so a client may
always retry it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

PROTOCOL_VERSION = 1
TOKEN_HEADER = "Authorization"  # value: "Bearer TOKEN"
TOKEN_ENV_VAR = "TIDERL_ENV_TOKEN"


class ErrorCode(Enum):
    """Machine-readable error codes and their HTTP status."""

    BAD_REQUEST = ("bad_request", 400)  # malformed JSON, missing or ill-typed field
    BAD_OPTIONS = ("bad_options", 400)  # the environment refused its options
    UNAUTHORIZED = ("unauthorized", 401)
    NOT_FOUND = ("not_found", 404)  # no such endpoint
    UNKNOWN_ENV = ("unknown_env", 404)
    UNKNOWN_SESSION = ("unknown_session", 404)
    METHOD_NOT_ALLOWED = ("method_not_allowed", 405)
    SESSION_PAUSED = ("session_paused", 409)
    SESSION_ENDED = ("session_ended", 409)  # ended by /end, reaped, or failed
    EPISODE_DONE = ("episode_done", 409)  # the episode finished; only /end (or pause) remains
    SESSION_BUSY = ("session_busy", 409)  # /observation or /end while a step is in progress
    TOO_LARGE = ("too_large", 413)
    AT_CAPACITY = ("at_capacity", 429)
    ENV_ERROR = ("env_error", 500)  # the environment raised; the session is ended
    INTERNAL = ("internal", 500)
    DRAINING = ("draining", 503)  # the server is shutting down

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
