"""The session table of one env server: states, capacity, idle reaping, paused expiry.

No HTTP and no I/O; the clock is injected so the timing rules are tested directly.

Invariants:
1. At most `max_sessions` sessions are live (active, paused or done) or being started,
   and at most `max_sessions_per_client` of them belong to one client (a client is a
   key the server gives: the token, or the peer address).
2. A paused session is never idle: its inactivity clock stops at /pause and restarts
   from zero at /resume.
3. A session is reaped only if it is not paused, has no request in progress, and has
   seen no request for longer than `idle_timeout_s`.
4. A session paused for longer than `max_paused_s` with no request in progress expires. The
   pause is counted from the first /pause of a lease: a lease ends only with a step
   (/observation), so neither a second /pause nor a /resume with a /pause after it (and no
   step between) extends it.
5. An ended session (by /end, reaping, expiry or an environment failure) is remembered by
   id, so requests naming it get "ended" (409) with the reason rather than "unknown" (404).
6. The n-th session the table starts for an (env, seed) has `seed_ordinal` n - 1 (counted for the
   `max_ended_kept` seeds started last): the tasks of one group share their seed, and the ordinal tells
   them apart in the key of their injected delays, whatever order their starts come in.
7. A session belongs to the client that started it: for any other client its id is
   unknown (404), live or ended, so no client can step, pause, resume or end another's.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from tiderl.envs.base import Environment
from tiderl.envs.protocol import ErrorCode, ProtocolError


class SessionState(Enum):
    ACTIVE = "active"
    PAUSED = "paused"
    DONE = "done"  # the episode finished; the session waits for /end


@dataclass
class Session:
    session_id: str
    env_name: str
    env: Environment
    seed: int
    state: SessionState
    created_s: float
    last_active_s: float
    client: str = ""  # who started it (invariant 1)
    paused_s: float | None = None  # the first /pause of the current lease (invariant 4); None: not paused
    num_steps: int = 0
    seed_ordinal: int = 0  # sessions of this env and seed the table started before it (the key of its delays)
    is_busy: bool = False
    is_episode_done: bool = False
    # The state to return to on /resume (ACTIVE or DONE).
    state_before_pause: SessionState = SessionState.ACTIVE


@dataclass(frozen=True)
class EndedSession:
    reason: str  # "ended" | "reaped" | "expired: ..." | "failed: ..."
    client: str = ""  # who started it (invariant 7)
    end_result: dict[str, Any] | None = None  # the /end answer, replayed if /end is repeated


@dataclass
class SessionTable:
    max_sessions: int
    idle_timeout_s: float
    max_paused_s: float | None = None  # None: paused sessions never expire
    max_sessions_per_client: int | None = None  # None: only max_sessions bounds a client
    clock: Callable[[], float] = time.monotonic
    max_ended_kept: int = 65536
    sessions: dict[str, Session] = field(default_factory=dict)
    ended: OrderedDict[str, EndedSession] = field(default_factory=OrderedDict)
    # Live and starting sessions per client (invariant 1); clients at zero are dropped.
    num_by_client: dict[str, int] = field(default_factory=dict)
    # Sessions started per (env, seed), at most max_ended_kept of them, the least recently started forgotten:
    # a session's ordinal among them keys its injected delays (invariant 6).
    seed_starts: dict[tuple[str, int], int] = field(default_factory=dict)
    num_starting: int = 0
    num_started: int = 0
    num_reaped: int = 0
    num_expired: int = 0
    num_ended: int = 0
    num_failed: int = 0

    def reserve(self, client: str = "") -> None:
        """Claim a slot for a session being started; AT_CAPACITY if none is free, CLIENT_LIMIT
        if `client` holds its share already."""
        if len(self.sessions) + self.num_starting >= self.max_sessions:
            raise ProtocolError(
                ErrorCode.AT_CAPACITY,
                f"server at capacity: {len(self.sessions)} live sessions, max_sessions={self.max_sessions}",
            )
        held = self.num_by_client.get(client, 0)
        if self.max_sessions_per_client is not None and held >= self.max_sessions_per_client:
            raise ProtocolError(
                ErrorCode.CLIENT_LIMIT,
                f"client {client or '?'} holds {held} sessions, max_sessions_per_client="
                f"{self.max_sessions_per_client}; end or let expire some of them first",
            )
        self.num_starting += 1
        self.num_by_client[client] = held + 1

    def release(self, client: str = "") -> None:
        """Give back a reserved slot whose session failed to start."""
        self.num_starting -= 1
        self._uncount(client)

    def _uncount(self, client: str) -> None:
        left = self.num_by_client[client] - 1
        if left:
            self.num_by_client[client] = left
        else:
            del self.num_by_client[client]

    def add(self, env_name: str, env: Environment, seed: int, client: str = "") -> Session:
        """Turn a slot `client` reserved into a live session."""
        self.num_starting -= 1
        now = self.clock()
        session = Session(
            session_id=uuid.uuid4().hex,
            env_name=env_name,
            env=env,
            seed=seed,
            state=SessionState.ACTIVE,
            created_s=now,
            last_active_s=now,
            client=client,
            seed_ordinal=self.seed_starts.get((env_name, seed), 0),
        )
        self.seed_starts.pop((env_name, seed), None)  # re-inserted last: the oldest seeds are forgotten first
        self.seed_starts[(env_name, seed)] = session.seed_ordinal + 1
        while len(self.seed_starts) > self.max_ended_kept:
            del self.seed_starts[next(iter(self.seed_starts))]
        self.sessions[session.session_id] = session
        self.num_started += 1
        return session

    def get(self, session_id: str, client: str | None = None) -> Session:
        """The live session `session_id`; with `client`, only if that client started it (invariant 7)."""
        session = self.sessions.get(session_id)
        if session is not None and (client is None or session.client == client):
            return session
        ended = self.ended.get(session_id)
        if ended is not None and (client is None or ended.client == client) and session is None:
            raise ProtocolError(ErrorCode.SESSION_ENDED, f"session {session_id} has ended ({ended.reason})")
        raise ProtocolError(ErrorCode.UNKNOWN_SESSION, f"unknown session {session_id}")

    def touch(self, session: Session) -> None:
        session.last_active_s = self.clock()

    def ended_result(self, session_id: str, client: str | None = None) -> dict[str, Any] | None:
        """The /end answer of a session `client` ended, to replay to a repeated /end."""
        ended = self.ended.get(session_id)
        if ended is None or (client is not None and ended.client != client):
            return None
        return ended.end_result

    def pause(self, session: Session) -> None:
        if session.state is not SessionState.PAUSED:
            session.state_before_pause = session.state
            session.state = SessionState.PAUSED
            if session.paused_s is None:  # the lease's first pause (invariant 4)
                session.paused_s = self.clock()
        self.touch(session)

    def resume(self, session: Session) -> None:
        """Back to its state before /pause; the lease's pause clock runs on until a step."""
        if session.state is SessionState.PAUSED:
            session.state = session.state_before_pause
        self.touch(session)

    def stepped(self, session: Session) -> None:
        """A step ran: the session's lease ends, a later /pause starts a new one (invariant 4)."""
        if session.state is not SessionState.PAUSED:
            session.paused_s = None
        self.touch(session)

    def remove(self, session: Session, reason: str, end_result: dict[str, Any] | None = None) -> None:
        del self.sessions[session.session_id]
        self._uncount(session.client)
        self.ended[session.session_id] = EndedSession(reason, session.client, end_result)
        while len(self.ended) > self.max_ended_kept:
            self.ended.popitem(last=False)
        if reason == "ended":
            self.num_ended += 1
        elif reason == "reaped":
            self.num_reaped += 1
        elif reason.startswith("expired"):
            self.num_expired += 1
        else:
            self.num_failed += 1

    def idle_sessions(self) -> list[Session]:
        """Sessions to reap now (invariant 3)."""
        deadline = self.clock() - self.idle_timeout_s
        return [
            s
            for s in self.sessions.values()
            if s.state is not SessionState.PAUSED and not s.is_busy and s.last_active_s < deadline
        ]

    def expired_sessions(self) -> list[Session]:
        """Paused sessions to end now (invariant 4)."""
        if self.max_paused_s is None:
            return []
        deadline = self.clock() - self.max_paused_s
        return [
            s
            for s in self.sessions.values()
            if s.state is SessionState.PAUSED and s.paused_s is not None and s.paused_s < deadline
            and not s.is_busy
        ]

    def counts(self) -> dict[str, int]:
        by_state = {state: 0 for state in SessionState}
        for s in self.sessions.values():
            by_state[s.state] += 1
        return {
            "active": by_state[SessionState.ACTIVE],
            "paused": by_state[SessionState.PAUSED],
            "done": by_state[SessionState.DONE],
            "sessions": len(self.sessions),
            "starting": self.num_starting,
            "max_sessions": self.max_sessions,
            "capacity_left": self.max_sessions - len(self.sessions) - self.num_starting,
            "num_started": self.num_started,
            "num_ended": self.num_ended,
            "num_reaped": self.num_reaped,
            "num_expired": self.num_expired,
            "num_failed": self.num_failed,
        }
