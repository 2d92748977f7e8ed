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

__all__ = ["MosquittoBroker", "RabbitMQNode", "find_mosquitto", "find_rabbitmq", "free_port", "wait_port",
           "MOSQUITTO_MISSING", "RABBITMQ_MISSING"]

MOSQUITTO_MISSING = "mosquitto not installed (apt-get install mosquitto); these benches need a real broker"
RABBITMQ_MISSING = "rabbitmq-server not installed (apt-get install rabbitmq-server)"
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
            "set_tcp_nodelay true\n"
            "log_dest stderr\n"
            "log_type error\n"
            "log_type warning\n"
        )
        self.conf.write_text(default if config is None else config)
        self._proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The running broker's process id (for CPU sampling)."""
        if self._proc is None or self._proc.poll() is not None:
            raise RuntimeError("mosquitto is not running")
        return self._proc.pid

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


def find_rabbitmq() -> Optional[str]:
    """Directory of RabbitMQ's own scripts (rabbitmq-server, rabbitmqctl), or None.

    The Debian package's /usr/sbin wrappers switch to the ``rabbitmq`` user and its home;
    the scripts under /usr/lib/rabbitmq/bin run as the caller, with the caller's environment,
    which is what a throw-away node in a temp dir needs."""
    for cand in ("/usr/lib/rabbitmq/bin", "/usr/local/lib/rabbitmq/bin", "/opt/homebrew/sbin"):
        if os.access(os.path.join(cand, "rabbitmq-server"), os.X_OK):
            return cand
    return None


class RabbitMQNode:
    """One RabbitMQ node with its MQTT plugin, on 127.0.0.1 and free ports, in a temp dir.

    Why RabbitMQ: it is a broker that clusters, so it shows that the product needs nothing
    Mosquitto-specific. Nodes given the same ``cookie_home`` share an Erlang cookie, so one can
    ``join(other)`` to form a cluster; each keeps its own MQTT listener. Killed at exit.
    """

    def __init__(self, name: str, cookie_home: Optional[str] = None, bindir: Optional[str] = None) -> None:
        bindir = bindir or find_rabbitmq()
        if bindir is None:
            raise RuntimeError(RABBITMQ_MISSING)
        self.bindir = bindir
        self.port = free_port()
        self._tmp = tempfile.TemporaryDirectory(prefix=f"sfl-rabbitmq-{name}-")
        work = Path(self._tmp.name)
        self.node = f"{name}{self.port}@localhost"
        (work / "rabbitmq.conf").write_text(
            "listeners.tcp = none\n"          # no AMQP listener: MQTT only
            f"mqtt.listeners.tcp.default = 127.0.0.1:{self.port}\n"
            "mqtt.allow_anonymous = true\n"
            "loopback_users = none\n"
            f"max_message_size = {MESSAGE_SIZE_LIMIT}\n"
            "tcp_listen_options.nodelay = true\n"
            "mqtt.tcp_listen_options.nodelay = true\n"
        )
        (work / "enabled_plugins").write_text("[rabbitmq_mqtt].\n")
        home = cookie_home or str(work)
        self.env = dict(
            os.environ, HOME=home, RABBITMQ_NODENAME=self.node,
            RABBITMQ_NODE_PORT=str(free_port()), RABBITMQ_DIST_PORT=str(free_port()),
            RABBITMQ_MNESIA_BASE=str(work / "mnesia"), RABBITMQ_LOG_BASE=str(work / "log"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(work / "enabled_plugins"),
            RABBITMQ_CONFIG_FILE=str(work / "rabbitmq"), RABBITMQ_PID_FILE=str(work / "pid"),
            RABBITMQ_LOGS=str(work / "rabbit.log"))
        self.log = work / "rabbit.log"
        self._proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def ctl(self, *args: str, timeout: float = 60) -> str:
        """Run ``rabbitmqctl -n NODE ARGS``; raise with its output if it fails."""
        out = subprocess.run([os.path.join(self.bindir, "rabbitmqctl"), "-n", self.node, *args],
                             env=self.env, capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed: {out.stdout}{out.stderr}")
        return out.stdout

    def start(self, timeout: float = 90.0) -> "RabbitMQNode":
        """Start the node and wait until its MQTT listener accepts connections."""
        atexit.register(self.close)
        self._proc = subprocess.Popen([os.path.join(self.bindir, "rabbitmq-server")], env=self.env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True)
        if not wait_port("127.0.0.1", self.port, timeout) or self._proc.poll() is not None:
            tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            self.close()
            raise RuntimeError(f"RabbitMQ node {self.node} did not open MQTT port {self.port}:\n{tail}")
        return self

    def join(self, other: "RabbitMQNode") -> None:
        """Make this node a member of ``other``'s cluster (its MQTT listener comes back after)."""
        self.ctl("stop_app")
        self.ctl("join_cluster", other.node)
        self.ctl("start_app")
        if not wait_port("127.0.0.1", self.port, 60):
            raise RuntimeError(f"RabbitMQ node {self.node} did not reopen MQTT after joining {other.node}")

    def close(self) -> None:
        """Kill the node's whole process group (the Erlang VM and epmd children) and its files."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, 9)
            except OSError:
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass
        try:
            self._tmp.cleanup()
        except OSError:
            pass
