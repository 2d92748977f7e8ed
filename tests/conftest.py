"""Shared pytest fixtures: real MQTT brokers on free local ports.

Tests talk to real brokers (Mosquitto as in production, amqtt as in the
zero-setup mode) rather than mocks, because the bugs that matter — lost
subscriptions after reconnect, wills, large payloads — live in the wire
behaviour, not in our code's call graph.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# Make the repository importable without `pip install -e .` (a fresh checkout runs its tests).
_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

MOSQUITTO_MISSING = "mosquitto not installed: apt-get install mosquitto"


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


def _find_mosquitto() -> str | None:
    found = shutil.which("mosquitto")
    if found:
        return found
    for cand in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto", "/opt/homebrew/sbin/mosquitto"):
        if os.access(cand, os.X_OK):
            return cand
    return None


class MosquittoProcess:
    """A throw-away Mosquitto on 127.0.0.1; ``stop()``/``start()`` keep the same port."""

    def __init__(self, binary: str, workdir: Path, port: int | None = None) -> None:
        self.binary = binary
        self.port = port or free_port()
        self.conf = workdir / "mosquitto.conf"
        self.log = workdir / "mosquitto.log"
        self.conf.write_text(
            f"listener {self.port} 127.0.0.1\n"
            "allow_anonymous true\n"
            "persistence false\n"
            # 64 MiB payloads plus headroom (max_packet_size needs Mosquitto >= 2.0)
            f"message_size_limit {64 * 2**20 + 65536}\n"
            "max_inflight_messages 0\n"
            "max_queued_messages 0\n"
            "log_dest stderr\n"
            "log_type error\n"
            "log_type warning\n"
        )
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> "MosquittoProcess":
        if self._proc is not None and self._proc.poll() is None:
            return self
        deadline = time.monotonic() + timeout
        while True:  # after stop() the port may linger briefly; retry until bound
            logf = open(self.log, "ab")
            self._proc = subprocess.Popen([self.binary, "-c", str(self.conf)],
                                          stdout=logf, stderr=subprocess.STDOUT)
            logf.close()
            if wait_port("127.0.0.1", self.port, min(3.0, max(0.1, deadline - time.monotonic()))) \
                    and self._proc.poll() is None:
                return self
            self._kill()
            if time.monotonic() >= deadline:
                tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
                raise RuntimeError(f"mosquitto did not start on port {self.port}:\n{tail}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Hard stop (SIGKILL): clients see their sockets drop, as in a broker crash."""
        self._kill()

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[MosquittoProcess]:
    binary = _find_mosquitto()
    if binary is None:
        if os.environ.get("SFL_REQUIRE_MOSQUITTO") == "1":
            pytest.fail(MOSQUITTO_MISSING)
        pytest.skip(MOSQUITTO_MISSING)
    broker = MosquittoProcess(binary, tmp_path)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def embedded_broker():
    from coordinator.broker import EmbeddedBroker

    broker = EmbeddedBroker(host="127.0.0.1", port=0).start()
    try:
        yield broker
    finally:
        broker.stop()
