"""Async client of the env service, used by rollout ranks.

The pool over several servers, with failover, is `tiderl.envs.pool.EnvPool`.

One `aiohttp.ClientSession` (a pooled connector) per client; every call has a
timeout; errors are `EnvServiceError`s naming the server URL and the session.

Retries are bounded (`max_retries`) and happen only where they are safe:
- any endpoint, when the connection could not be opened (the request never left)
  or the server answered 429/503 (it refused before changing state);
- /health, /pause, /resume and /end also on timeouts and dropped connections
  (they are idempotent: /end replays its first answer).
/start and /observation are never retried once the request may have reached the
server: a retried /observation could apply an action twice.

Images: the answers of an image environment carry the observation's PNG images
(`protocol.parse_images`, checked against the client's `image_limits`); they are the
`images` of `StartResult` and of `StepWithImages` (a `StepResult`: text-only code unpacks
its four fields as before). A bad image is an `EnvProtocolError` naming the image.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Any

import aiohttp

from tiderl.envs.base import StepResult
from tiderl.envs.images import ImageError, ImageLimits, PngImage
from tiderl.envs.protocol import TOKEN_HEADER, parse_images



class EnvServiceError(Exception):
    """A request to an env server failed; names the server, endpoint and session."""

    def __init__(
        self, url: str, endpoint: str, message: str, *, session_id: str | None = None,
        status: int | None = None, code: str | None = None,
    ) -> None:
        self.url = url
        self.endpoint = endpoint
        self.session_id = session_id
        self.status = status
        self.code = code
        self.message = message
        where = f"env server {url}{endpoint}"
        if session_id is not None:
            where += f" (session {session_id})"
        what = f"{status} {code}: " if status is not None else ""
        super().__init__(f"{where}: {what}{message}")


class EnvBadRequestError(EnvServiceError):
    """400: the request or the env options were refused."""


class EnvAuthError(EnvServiceError):
    """401: missing or wrong token."""


class EnvNotFoundError(EnvServiceError):
    """404: unknown environment or session."""


class EnvConflictError(EnvServiceError):
    """409: the session is paused, ended, done, or busy."""


class EnvBusyError(EnvServiceError):
    """429/503: the server is at capacity or shutting down (still so after the retries)."""


class EnvFailedError(EnvServiceError):
    """5xx: the environment or the server failed."""


class EnvConnectionError(EnvServiceError):
    """No answer: connection refused or dropped, or timeout."""


class EnvProtocolError(EnvServiceError):
    """An answer outside the protocol: not UTF-8, not a JSON object, or a field missing or of the wrong type."""


_BY_STATUS: dict[int, type[EnvServiceError]] = {
    400: EnvBadRequestError, 401: EnvAuthError, 404: EnvNotFoundError, 409: EnvConflictError,
    413: EnvBadRequestError, 429: EnvBusyError, 503: EnvBusyError,
}
_IDEMPOTENT = frozenset({"/health", "/pause", "/resume", "/end"})


@dataclass(frozen=True)
class StartResult:
    session_id: str
    observation: str
    done: bool
    info: dict[str, Any]
    images: tuple[PngImage, ...] = ()
    """The first observation's images, shown before its text (none for a text environment)."""


class StepWithImages(StepResult):
    """A `StepResult` (four fields, unpacked as four) with the observation's images as well."""

    images: tuple[PngImage, ...] = ()  # also what a copy made by `_replace` or `_make` has

    def __new__(cls, observation: str, reward: float, done: bool, info: dict[str, Any],
                images: tuple[PngImage, ...] = ()) -> StepWithImages:
        self = super().__new__(cls, observation, reward, done, info)
        self.images = tuple(images)
        return self

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, images={len(self.images)})"


@dataclass(frozen=True)
class EndResult:
    reward: float
    info: dict[str, Any]


class EnvClient:
    """Client of one env server. Use as `async with EnvClient(url) as client:`."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout_s: float = 120.0,
        connect_timeout_s: float = 10.0,
        max_retries: int = 3,
        retry_backoff_s: float = 0.2,
        max_connections: int = 512,
        image_limits: ImageLimits = ImageLimits(),
    ) -> None:
        self.url = url.rstrip("/")
        self.image_limits = image_limits
        self.token = token
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> EnvClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {TOKEN_HEADER: f"Bearer {self.token}"} if self.token else {}
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections),
                timeout=self.timeout,
                headers=headers,
            )
        return self._session

    async def _request(
        self, method: str, endpoint: str, body: dict[str, Any] | None = None, session_id: str | None = None
    ) -> dict[str, Any]:
        attempt = 0
        while True:
            try:
                return await self._request_once(method, endpoint, body, session_id)
            except EnvServiceError as e:
                if attempt >= self.max_retries or not self._is_retryable(e, endpoint):
                    raise
                attempt += 1
                await asyncio.sleep(self.retry_backoff_s * 2 ** (attempt - 1))

    @staticmethod
    def _is_retryable(e: EnvServiceError, endpoint: str) -> bool:
        if isinstance(e, EnvBusyError):
            return True
        if isinstance(e, EnvConnectionError):
            return e.code == "connect_failed" or endpoint in _IDEMPOTENT
        return False

    async def _request_once(
        self, method: str, endpoint: str, body: dict[str, Any] | None, session_id: str | None
    ) -> dict[str, Any]:
        url = self.url + endpoint
        try:
            async with self._http().request(method, url, json=body) as resp:
                raw = await resp.read()
                text, data = _decode(raw)
                if resp.status == 200 and isinstance(data, dict):
                    return data
                if resp.status == 200:
                    what = "not UTF-8" if text is None else "not a JSON object"
                    shown = raw[:80] if text is None else text[:80]
                    raise EnvProtocolError(self.url, endpoint, f"answer is {what} ({len(raw)} bytes): {shown!r}",
                                           session_id=session_id, status=200, code="bad_answer")
                message = data.get("error", "") if isinstance(data, dict) else raw[:200].decode(errors="replace")
                code = data.get("code") if isinstance(data, dict) else None
                cls = _BY_STATUS.get(resp.status, EnvFailedError if resp.status >= 500 else EnvServiceError)
                raise cls(self.url, endpoint, str(message) or resp.reason or "", session_id=session_id,
                          status=resp.status, code=code if isinstance(code, str) else None)
        except aiohttp.ClientConnectorError as e:
            raise EnvConnectionError(self.url, endpoint, f"cannot connect: {e}", session_id=session_id,
                                     code="connect_failed") from e
        except asyncio.TimeoutError as e:
            raise EnvConnectionError(self.url, endpoint, f"no answer within {self.timeout.total} s",
                                     session_id=session_id, code="timeout") from e
        except aiohttp.ClientError as e:
            raise EnvConnectionError(self.url, endpoint, f"{type(e).__name__}: {e}", session_id=session_id,
                                     code="connection_lost") from e

    async def start(self, env: str, seed: int, options: dict[str, Any] | None = None) -> StartResult:
        data = await self._request("POST", "/start", {"env": env, "seed": seed, "options": options or {}})
        f = _Fields(self.url, "/start", data, None)
        return StartResult(f.get("session_id", str), f.get("observation", str), f.get("done", bool), f.info(),
                           f.images(self.image_limits))

    async def step(self, session_id: str, action: str) -> StepWithImages:
        """One environment step (POST /observation)."""
        data = await self._request("POST", "/observation", {"session_id": session_id, "action": action}, session_id)
        f = _Fields(self.url, "/observation", data, session_id)
        return StepWithImages(f.get("observation", str), f.get("reward", float), f.get("done", bool), f.info(),
                              f.images(self.image_limits))

    async def pause(self, session_id: str) -> str:
        data = await self._request("POST", "/pause", {"session_id": session_id}, session_id)
        return str(data["state"])

    async def resume(self, session_id: str) -> str:
        data = await self._request("POST", "/resume", {"session_id": session_id}, session_id)
        return str(data["state"])

    async def end(self, session_id: str) -> EndResult:
        data = await self._request("POST", "/end", {"session_id": session_id}, session_id)
        f = _Fields(self.url, "/end", data, session_id)
        return EndResult(f.get("reward", float), f.info())

    async def health(self) -> dict[str, Any]:
        return await self._request("GET", "/health")


def _decode(raw: bytes) -> tuple[str | None, Any]:
    """(the body as text, None where it is not UTF-8; the JSON value, None where it is not JSON)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, None
    try:
        return text, json.loads(text)
    except ValueError:
        return text, None


class _Fields:
    """The fields of one answer, each checked: a missing or mistyped one is an EnvProtocolError naming it."""

    def __init__(self, url: str, endpoint: str, data: dict[str, Any], session_id: str | None) -> None:
        self.url, self.endpoint, self.data, self.session_id = url, endpoint, data, session_id

    def get(self, key: str, kind: type) -> Any:
        value = self.data.get(key)
        ok = isinstance(value, kind) if kind is not float else (
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))
        if not ok:
            shown = "missing" if key not in self.data else f"{type(value).__name__} {str(value)[:40]!r}"
            raise EnvProtocolError(self.url, self.endpoint, f"answer field {key!r}: want {kind.__name__}, got {shown}",
                                   session_id=self.session_id, status=200, code="bad_answer")
        return float(value) if kind is float else value

    def images(self, limits: ImageLimits) -> tuple[PngImage, ...]:
        if "images" not in self.data:
            return ()
        try:
            return parse_images(self.data["images"], limits)
        except ImageError as e:
            raise EnvProtocolError(self.url, self.endpoint, f"answer field 'images': {e}", session_id=self.session_id,
                                   status=200, code="bad_answer") from e

    def info(self) -> dict[str, Any]:
        info = self.data.get("info", {})
        if not isinstance(info, dict):
            raise EnvProtocolError(self.url, self.endpoint, f"answer field 'info': want an object, got "
                                   f"{type(info).__name__}", session_id=self.session_id, status=200, code="bad_answer")
        return info
