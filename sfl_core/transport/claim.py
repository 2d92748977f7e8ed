"""One live process per name on a broker: an agent id, or a run's coordinator.

Problem: two processes started with one identity (an agent id, or the coordinator of a run)
would answer for each other; but a process that died before its last will fired leaves an
online status behind that must not block its restart.

Algorithm: every process publishes a retained online status carrying its random instance id
(its last will says offline) and reads that topic. The broker orders the messages of a
topic, so of two live processes exactly one sees the other's online status *before* the
echo of its own: that one is the newcomer. A running process answers every other instance's
status by announcing itself again (once per instance, so two processes never answer each
other forever). The newcomer waits ``claim_s`` for that answer: if it comes, the name is
taken; if not, the status was a dead predecessor's, and the name is taken over.

Used by the agent runner (``sfl/R/status/A``) and the coordinator's transport
(``sfl/R/coordinator``); this class holds the bookkeeping, the callers their topics and
messages.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional


class Claim:
    def __init__(self, instance: str, announce: Callable[[], None]):
        """``instance``: this process's id; ``announce``: publish our online status again."""
        self.instance = instance
        self._announce = announce
        self._own_seen = threading.Event()
        self.rival: Optional[dict[str, Any]] = None
        """The status body of another instance seen online before our own echo."""
        self._rival_alive = threading.Event()
        self._answered: set[str] = set()
        self.held = False

    def observe(self, body: dict[str, Any]) -> Optional[str]:
        """Feed one status message's body (``online``, ``instance``, ...). Returns the other
        instance's id when we answered it (a newcomer, or its will), for the caller to log."""
        other = body["instance"]
        if other == self.instance:
            self._own_seen.set()
        elif not self._own_seen.is_set():
            if body["online"]:
                self.rival = body                 # announced before us: we are the newcomer
        elif self.rival is not None and other == self.rival["instance"]:
            if body["online"]:
                self._rival_alive.set()           # it answered our status: it runs
        elif self.held and other not in self._answered:
            # a newcomer, or its will (which overwrote our retained status): show that we run
            self._answered.add(other)
            self._announce()
            return other
        return None

    def decide(self, claim_s: float, own_timeout_s: float = 10.0) -> Optional[dict[str, Any]]:
        """After our own announcement: the live rival's status body (the name is taken), or
        None (ours now). ``own_timeout_s``: how long to wait for our own echo; without it (an
        ACL that hides the topic from us) nothing can be told and the name is ours."""
        if self._own_seen.wait(own_timeout_s) and self.rival is not None and self._rival_alive.wait(claim_s):
            return self.rival
        self.held = True
        return None

    @property
    def own_seen(self) -> bool:
        return self._own_seen.is_set()
