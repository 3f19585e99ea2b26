"""Agent sessions: the exact record of every model call an agent episode makes through the server, its reward,
and (online mode) the episodes offered to agents that run in other processes.

A session is one agent episode. Its calls go to ``/sessions/{id}/v1/...`` (an ordinary OpenAI base URL, so any
client works unchanged); the server records each finished call as the engine ran it (:class:`Call`: the prompt
token ids the server built, the completion ids, the behaviour log-probs and the policy version of every token),
never as text. The reward comes from the agent's return value (in-process agents) or from ``POST
/v1/sessions/{id}/reward`` (agents anywhere).

Online mode: the RL workflow *offers* an episode (a dataset row under a staleness ticket) and waits; an external
process claims it with ``POST /v1/sessions`` (429 when nothing is offered: the run's staleness budget is spent),
makes its calls under the returned base URL and reports the reward, which ends the session. So online sessions
are admitted by the same eta rule and the same data ledger as any rollout.

Thread-safety: routes run on the server's event loop, records arrive from the generator's pump threads, the
workflow waits in rollout worker threads; one lock guards the store, each session has its own condition.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import secrets
import threading
import time
from typing import Any

from jaxrl_async.serve.protocol import APIError

__all__ = ["Call", "Session", "SessionStore"]


@dataclasses.dataclass
class Call:
    """One sample of one model call of a session, exactly as generated."""

    seq: int  # submission order within the session
    endpoint: str  # "chat" or "cmpl"
    sample_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str


class Session:
    """One agent episode's calls and reward (see the module docstring)."""

    def __init__(self, sid: str, row: Any = None, online: bool = False):
        self.id, self.row, self.online = sid, row, online
        self.created = time.monotonic()
        self.calls: list[Call] = []
        self.aborted_calls = 0  # calls that ended without a delivered answer (client gone, timeout): not trained
        self.reward: float | None = None
        self.claimed = not online  # online sessions start unclaimed: offered, waiting for an agent
        self.ended = False
        self.cond = threading.Condition()
        self._seq = 0
        self._expected = 0
        self._recorded = 0

    def next_seq(self, requests: int = 1) -> int:
        """The next call's submission number; the call's ``requests`` (one per prompt) are pending until their
        records arrive (the server gives every request one record: finished, or lost)."""
        with self.cond:
            self._seq += 1
            self._expected += requests
            return self._seq - 1

    @property
    def pending(self) -> int:
        """Requests submitted whose record has not arrived (a streamed answer can reach the agent just before it)."""
        return self._expected - self._recorded

    def add(self, calls: list[Call], aborted: int) -> None:
        with self.cond:
            self.calls.extend(calls)
            self.aborted_calls += aborted
            self._recorded += 1
            self.cond.notify_all()

    def ordered_calls(self) -> list[Call]:
        with self.cond:
            return sorted(self.calls, key=lambda c: (c.seq, c.sample_index))

    def wait(self, predicate: Any, timeout: float | None) -> bool:
        """Wait (at most ``timeout`` s) until ``predicate(self)``; True if it holds."""
        with self.cond:
            return self.cond.wait_for(lambda: predicate(self), timeout=timeout)


class SessionStore:
    """Sessions by id; hooked into a ``ServeBackend`` as a recorder (``backend.recorders.append(store.record)``).

    Args:
      max_sessions: open sessions at most (a leak guard: episodes end their sessions).
    """

    def __init__(self, max_sessions: int = 4096):
        self.max_sessions = int(max_sessions)
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._offers: collections.deque[Session] = collections.deque()  # online: waiting to be claimed
        self.ended_sessions = 0

    # -- lifecycle ------------------------------------------------------------------------------
    def open(self, row: Any = None, online: bool = False) -> Session:
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                raise RuntimeError(f"{len(self._sessions)} agent sessions open (the limit is {self.max_sessions}); "
                                   "episodes must end their sessions")
            s = Session("sess-" + secrets.token_hex(12), row, online)
            self._sessions[s.id] = s
            if online:
                self._offers.append(s)
            return s

    def end(self, session: Session) -> None:
        """Forget ``session`` (its calls stay on the object); later calls under its URL get 404."""
        with session.cond:
            session.ended = True
            session.cond.notify_all()
        with self._lock:
            if self._sessions.pop(session.id, None) is not None:
                self.ended_sessions += 1
            try:
                self._offers.remove(session)
            except ValueError:
                pass

    def get(self, sid: str, param: str = "session") -> Session:
        with self._lock:
            s = self._sessions.get(sid)
        if s is None or s.ended:
            raise APIError(404, f"{param}: no open session {sid!r} (ended, or never opened)", param=param,
                           code="session_not_found")
        if not s.claimed:
            raise APIError(409, f"{param}: session {sid!r} has not been claimed (POST /v1/sessions first)",
                           param=param, code="session_unclaimed")
        if s.reward is not None:
            raise APIError(409, f"{param}: session {sid!r} already has its reward; open a new one", param=param,
                           code="session_finished")
        return s

    def claim(self) -> Session:
        """Online: the oldest offered episode, now claimed; 429 when none is offered."""
        with self._lock:
            while self._offers:
                s = self._offers.popleft()
                if not s.ended:
                    break
            else:
                raise APIError(429, "no episode is offered right now: the run's staleness budget is spent or every "
                                    "offered episode is claimed; retry later", code="no_episode")
        with s.cond:
            s.claimed = True
            s.cond.notify_all()
        return s

    def set_reward(self, sid: str, reward: Any) -> Session:
        s = self.get(sid)
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(float(reward)):
            raise APIError(400, f"reward: must be a finite number, got {reward!r}", param="reward")
        with s.cond:
            s.reward = float(reward)
            s.cond.notify_all()
        return s

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"open": len(self._sessions), "offered": len(self._offers), "ended": self.ended_sessions}

    # -- recording (a ServeBackend recorder: called from the pump threads) ------------------------------
    def record(self, rec: Any) -> None:
        meta = rec.metadata if isinstance(rec.metadata, dict) else {}
        sid = meta.get("session")
        if sid is None:
            return
        with self._lock:
            s = self._sessions.get(sid)
        if s is None:  # ended while the call ran (e.g. the episode timed out): nothing to keep
            return
        calls, aborted = [], int(getattr(rec, "lost", False))
        for smp in rec.samples:
            if smp.finish_reason not in ("stop", "length"):  # aborted / failed: the agent never saw it
                aborted += 1
                continue
            calls.append(Call(int(meta.get("seq", 0)), rec.endpoint, int(smp.sample_index), list(rec.prompt_ids),
                              [int(t) for t in smp.completion_ids], [float(x) for x in smp.logprobs],
                              [int(v) for v in smp.versions], smp.finish_reason))
        s.add(calls, aborted)
