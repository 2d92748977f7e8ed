"""One coordinator per output directory: an exclusive lock the kernel releases on death.

Why a lock and not a PID file: a PID file outlives a crash (and the PID is reused), so a
restart would have to guess whether it is stale. ``flock`` on ``<out>/.lock`` is held as
long as the process lives and released by the kernel however it dies (SIGKILL included),
so a restart under systemd never waits for a stale claim, and a second coordinator started
while the first lives is refused before it touches a file. The lock file holds the owner's
pid, host and start time for the one line the second one prints, and for
``sfl-coord dashboard`` to tell a running run from a finished one.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Optional

LOCK_FILE = ".lock"


class RunLocked(RuntimeError):
    """Another live process holds the run directory; the message names it."""


class RunLock:
    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / LOCK_FILE
        self._fd: Optional[int] = None

    def acquire(self, run_id: str) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            owner = holder(self.path.parent) or {}
            raise RunLocked(f"{self.path.parent} is in use by another coordinator (pid {owner.get('pid', '?')} on "
                            f"{owner.get('host', '?')}, run {owner.get('run', '?')!r}, started "
                            f"{owner.get('started', '?')}); stop it first (this one changed nothing)") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "run": run_id,
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)   # closing the descriptor releases the lock
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def holder(out_dir: Path) -> Optional[dict[str, Any]]:
    """Who holds ``out_dir``'s lock now (its pid, host, run, start), or None when nobody does."""
    path = Path(out_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:   # held: read who
            try:
                return json.loads(path.read_text() or "{}")
            except (OSError, ValueError):
                return {}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
