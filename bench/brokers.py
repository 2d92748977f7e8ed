"""A throw-away Mosquitto for the benchmarks.

Why a real Mosquitto and not the embedded amqtt broker: the benches measure what a
deployment pays per message, and production runs against Mosquitto (see `sfl-coord broker-config`).
The test suite's ``mosquitto`` fixture (tests/conftest.py) uses this same class, so a bench
and a test exercise the same broker configuration.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

__all__ = ["MosquittoBroker", "find_mosquitto", "free_port", "wait_port", "MOSQUITTO_MISSING"]

MOSQUITTO_MISSING = "mosquitto not installed (apt-get install mosquitto); these benches need a real broker"
MESSAGE_SIZE_LIMIT = 64 * 2**20 + 65536
"""The protocol's 64 MiB message bound plus room for MQTT headers (same as the tests)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(host: str, port: int, timeout: float) -> bool:
    """True once ``host:port`` accepts a TCP connection."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def find_mosquitto() -> Optional[str]:
    """Path of the mosquitto binary (PATH first, then the usual sbin locations), or None."""
    found = shutil.which("mosquitto")
    if found:
        return found
    for cand in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto", "/opt/homebrew/sbin/mosquitto"):
        if os.access(cand, os.X_OK):
            return cand
    return None


class MosquittoBroker:
    """Mosquitto on 127.0.0.1 and a free port, config in a temp dir, killed at exit.

    Use as a context manager; ``atexit`` also kills it, so a bench that dies with an
    exception does not leave a broker behind.
    """

    def __init__(self, binary: Optional[str] = None, port: Optional[int] = None,
                 config: Optional[str] = None) -> None:
        """``config``: a complete mosquitto.conf text to use instead of the default (it must
        open a listener on ``port``), e.g. one from ``sfl-coord broker-config``."""
        binary = binary or find_mosquitto()
        if binary is None:
            raise RuntimeError(MOSQUITTO_MISSING)
        self.binary = binary
        self.port = port or free_port()
        self._tmp = tempfile.TemporaryDirectory(prefix="sfl-bench-mosquitto-")
        workdir = Path(self._tmp.name)
        self.conf = workdir / "mosquitto.conf"
        self.log = workdir / "mosquitto.log"
        default = (
            f"listener {self.port} 127.0.0.1\n"
            "allow_anonymous true\n"
            "persistence false\n"
            f"message_size_limit {MESSAGE_SIZE_LIMIT}\n"
            "max_inflight_messages 0\n"
            "max_queued_messages 0\n"
            "log_dest stderr\n"
            "log_type error\n"
            "log_type warning\n"
        )
        self.conf.write_text(default if config is None else config)
        self._proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def version(self) -> str:
        """First line of ``mosquitto -h`` (e.g. 'mosquitto version 2.0.18'), for the JSON record."""
        try:
            out = subprocess.run([self.binary, "-h"], capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            return "unknown"
        lines = (out.stdout or out.stderr).strip().splitlines()
        return lines[0] if lines else "unknown"

    def start(self, timeout: float = 10.0) -> "MosquittoBroker":
        """Start (or restart after ``stop()``) on the same port; retries while the port lingers."""
        if self._proc is not None and self._proc.poll() is None:
            return self
        atexit.register(self.close)
        deadline = time.monotonic() + timeout
        while True:
            with open(self.log, "ab") as logf:
                self._proc = subprocess.Popen([self.binary, "-c", str(self.conf)], stdout=logf,
                                              stderr=subprocess.STDOUT)
            if wait_port("127.0.0.1", self.port, min(3.0, max(0.1, deadline - time.monotonic()))) \
                    and self._proc.poll() is None:
                return self
            self.stop()
            if time.monotonic() >= deadline:
                tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
                raise RuntimeError(f"mosquitto did not start on port {self.port}:\n{tail}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Hard stop (SIGKILL): clients see their sockets drop, as in a broker crash.
        The configuration stays, so ``start()`` brings it back on the same port."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass

    def close(self) -> None:
        """Stop and remove the temporary configuration."""
        self.stop()
        try:
            self._tmp.cleanup()
        except OSError:
            pass

    def __enter__(self) -> "MosquittoBroker":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
