"""How the env server reads a request and writes its answer, on aiohttp.

A request carries the server's token, if it has one, as `Authorization: Bearer TOKEN`
(`check_token`). A body must be no larger than `max_body_bytes` and arrive within `body_timeout_s`
once its headers have; it is then checked by `protocol.parse_body` (JSON depth and
text). Answers are JSON; a `ProtocolError` is answered with its code's HTTP status.
A client that hangs up mid-request is `ClientGone`: nobody reads its answer.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from tiderl.envs.protocol import TOKEN_HEADER, ErrorCode, ProtocolError, describe_non_ascii, parse_body

_HTTP_CODES = {
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
    413: ErrorCode.TOO_LARGE,
    400: ErrorCode.BAD_REQUEST,
}


class ClientGone(Exception):
    """The client disconnected before its request was done; nobody reads the answer."""


def check_token(request: web.Request, token: str | None) -> None:
    """A `ProtocolError` unless the request carries `token` (if the server has one) as
    `Authorization: Bearer TOKEN`; a header that is not ASCII is a 400 either way."""
    given = request.headers.get(TOKEN_HEADER)
    problem = None if given is None else describe_non_ascii(TOKEN_HEADER, given)
    if problem is not None:
        raise ProtocolError(ErrorCode.BAD_REQUEST, problem)
    if token is not None:
        scheme, _, value = (given or "").partition(" ")
        if scheme != "Bearer" or not hmac.compare_digest(value.encode(), token.encode()):
            raise ProtocolError(ErrorCode.UNAUTHORIZED, "missing or wrong token (Authorization: Bearer TOKEN)")


async def read_body(request: web.Request, *, max_body_bytes: int, body_timeout_s: float) -> Any:
    """The request's body, parsed: a `ProtocolError` if it is too large, late, unreadable
    or not valid JSON; `ClientGone` if the client disconnects while sending it."""
    endpoint = request.path
    if request.content_length is not None and request.content_length > max_body_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"{endpoint}: body of {request.content_length} bytes is over the limit of {max_body_bytes}",
        )
    try:
        async with asyncio.timeout(body_timeout_s):
            raw = await request.read()
    except TimeoutError as e:
        raise ProtocolError(
            ErrorCode.REQUEST_TIMEOUT, f"{endpoint}: body not received within {body_timeout_s:g} s"
        ) from e
    except web.HTTPRequestEntityTooLarge as e:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{endpoint}: body is over the limit of {max_body_bytes} bytes") from e
    except ConnectionError as e:
        raise ClientGone(f"client disconnected mid-body ({type(e).__name__}: {e})") from e
    except web.RequestPayloadError as e:  # a broken chunked encoding, a body that is not the gzip it says
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{endpoint}: body could not be read: {e}") from e
    return parse_body(raw, endpoint)


def is_connected(request: web.Request) -> Callable[[], bool]:
    """Whether the request's client is still there, asked later (e.g. by a queued env call)."""
    return lambda: request.transport is not None and not request.transport.is_closing()


def json_response(data: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        text=json.dumps(data, default=str), status=status, content_type="application/json", headers=headers
    )


def error_response(err: ProtocolError) -> web.Response:
    headers = {"Retry-After": "1"} if err.code.status in (429, 503) else None
    if err.code is ErrorCode.UNAUTHORIZED:
        headers = {"WWW-Authenticate": "Bearer"}
    response = json_response(err.to_json(), status=err.code.status, headers=headers)
    if err.code is ErrorCode.REQUEST_TIMEOUT:
        response.force_close()  # the rest of the body may still be on its way
    return response


def http_error_response(request: web.Request, e: web.HTTPException) -> web.Response:
    """aiohttp's own error (no such route, wrong method, body too large) as a protocol error."""
    code = _HTTP_CODES.get(e.status, ErrorCode.INTERNAL if e.status >= 500 else ErrorCode.BAD_REQUEST)
    return json_response({"error": f"{request.method} {request.path}: {e.reason}", "code": code.code}, e.status)
