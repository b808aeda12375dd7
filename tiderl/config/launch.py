"""`launch:` section: ranks, run directory and liveness."""

from __future__ import annotations

from tiderl.config.schema import option, section


@section
class LaunchConfig:
    num_ranks: int = option(4, ge=2, help="Ranks of the run (one accelerator each; one CPU slot locally).")
    rollout_fraction: float = option(
        0.5,
        gt=0,
        le=1,
        help="Share of ranks that start in the rollout role (fixed for `async`; ERS moves it for `tiderl`).",
    )
    runs_dir: str = option("runs", help="Where `tiderl run` makes run directories when --run-dir is not given.")
    heartbeat_s: float = option(2.0, gt=0, help="Seconds between a rank's heartbeats.")
    heartbeat_timeout_s: float = option(
        30.0, gt=0, help="A rank silent this long is dead: its claims return to the pool."
    )
    restarts: int = option(
        3, ge=0, help="`tiderl run`: times the launcher restarts each process of the run that dies: the control "
        "plane, an env server (on its port), a rank that was rolling out (its tasks go back to the pool, it rejoins "
        "at the next sync boundary). A rank that dies as actor or ref fails the run (`tiderl run --resume` "
        "continues it), as does a death past this count. 0: never restart."
    )

    def __post_init__(self) -> None:
        if self.heartbeat_timeout_s <= self.heartbeat_s:
            raise ValueError(
                f"heartbeat_timeout_s: must be > heartbeat_s ({self.heartbeat_s}), got {self.heartbeat_timeout_s}"
            )
