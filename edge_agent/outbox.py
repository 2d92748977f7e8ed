"""The agent's uplink: its messages to the coordinator, sent in order by one thread.

Publishing a message waits for the broker's acknowledgement of every chunk (QoS 1), which on
a slow link is the whole upload. Done in the thread that trains, the device would sit idle
for it; with steps in flight (the assignment's ``window``) it computes the next step while
this thread sends the last one. One thread keeps the order the coordinator relies on, and
one message on the link at a time is what a device's radio does; under ``--emulate`` the
profile's upload time is spent here, beside the compute, for the same reason.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Optional

log = logging.getLogger("sfl.agent")


class Outbox:
    def __init__(self, send: Callable[[str, bytes], None], *, uplink: Optional[Callable[[int], None]] = None,
                 sent: Optional[Callable[[], None]] = None):
        """``send``: publish one encoded message on a topic (its chunks, each acknowledged); ``uplink``: the
        emulated link's time for that many bytes (``--emulate``); ``sent``: called after each."""
        self._send, self._uplink, self._sent = send, uplink, sent
        self._queue: "queue.Queue[Optional[tuple[str, bytes]]]" = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="sfl-uplink", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Messages handed over and not yet sent (the device is still busy with them)."""
        return self._pending

    def put(self, topic: str, payload: bytes) -> None:
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._queue.put((topic, payload))

    def flush(self, timeout: float) -> bool:
        """Wait until everything handed over went out (False: still sending after ``timeout``)."""
        return self._idle.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (up to ``timeout``), then stop the thread."""
        self.flush(timeout)
        self._queue.put(None)
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            topic, payload = item
            try:
                if self._uplink is not None:
                    self._uplink(len(payload))
                self._send(topic, payload)
                if self._sent is not None:
                    self._sent()
            except Exception as exc:   # a send that fails must not stop the ones after it
                log.warning("could not send a message to the coordinator: %s", exc)
            finally:
                with self._lock:
                    self._pending -= 1
                    if not self._pending:
                        self._idle.set()
