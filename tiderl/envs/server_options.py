"""What the operator sets for an env server (`tiderl env serve`'s flags, the run launcher's
`env:` config): limits on sessions, connections, requests, images and threads, each checked
when the options are made, and whether operator-only environment options (pytool's
`sandbox: unsafe`) may be asked for."""

from __future__ import annotations

from dataclasses import dataclass

from tiderl.envs.images import ImageLimits

_IMAGE_DEFAULTS = ImageLimits()


@dataclass(frozen=True, kw_only=True)
class ServerOptions:
    envs: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 0
    max_sessions: int = 512
    idle_timeout_s: float = 300.0
    max_paused_s: float = 3600.0  # a session paused longer than this expires
    max_sessions_per_client: int | None = None  # None: see `client_cap`
    latency: str = "none"
    token: str | None = None
    max_workers: int = 32  # threads for blocking environments
    max_queued_steps: int = 256  # blocking env calls that may wait for a thread; more get 429
    max_body_bytes: int = 4 << 20
    max_connections: int = 1024  # lowered to fit the open-file limit (`connection_cap`)
    header_timeout_s: float = 10.0  # a request's headers must arrive within this
    body_timeout_s: float = 30.0  # a request's body must arrive within this once its headers have
    keepalive_timeout_s: float = 30.0  # an idle keep-alive connection is closed after this
    latency_seed: int = 0  # the delays' key (LatencyProfile.keyed_s) holds it: the run launcher sets seed and server
    max_images_per_observation: int = _IMAGE_DEFAULTS.max_images  # an environment's observation with more fails
    max_image_bytes: int = _IMAGE_DEFAULTS.max_bytes  # PNG bytes of one image
    max_image_pixels: int = _IMAGE_DEFAULTS.max_pixels  # width * height of one image
    # Per client (`client_key`: every loopback address is one): connections, and those still awaiting
    # their request's headers. None: a quarter of max_connections, and 64.
    max_connections_per_client: int | None = None
    max_half_open_per_client: int = 64
    # The operator's, never the client's: options an environment marks operator-only (pytool's
    # sandbox: unsafe) are refused (403) unless the server was started allowing them.
    allow_unsafe_sandbox: bool = False

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_workers", "max_body_bytes", "max_connections",
                     "max_images_per_observation", "max_image_bytes", "max_image_pixels",
                     "max_half_open_per_client"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("idle_timeout_s", "max_paused_s", "header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_queued_steps < 0:
            raise ValueError(f"max_queued_steps must be >= 0, got {self.max_queued_steps}")
        if self.max_connections_per_client is not None and self.max_connections_per_client < 1:
            raise ValueError(f"max_connections_per_client must be >= 1, got {self.max_connections_per_client}")
        if self.max_sessions_per_client is not None and self.max_sessions_per_client < 1:
            raise ValueError(f"max_sessions_per_client must be >= 1, got {self.max_sessions_per_client}")

    @property
    def image_limits(self) -> ImageLimits:
        return ImageLimits(max_images=self.max_images_per_observation, max_bytes=self.max_image_bytes,
                           max_pixels=self.max_image_pixels)

    @property
    def client_cap(self) -> int:
        """Sessions one client may hold: `max_sessions_per_client` if set; else, with a token,
        all of `max_sessions` (every holder of the token is one client, the run itself), and
        without one, all but a quarter, so that no one address can take every slot."""
        if self.max_sessions_per_client is not None:
            return self.max_sessions_per_client
        if self.token is not None:
            return self.max_sessions
        return max(1, self.max_sessions - self.max_sessions // 4)
