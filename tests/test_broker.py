"""MQTT plumbing against real brokers: URL parsing, MqttLink, EmbeddedBroker, Mosquitto.

Both brokers are exercised with the same tests (parametrized) because the
coordinator may run on either: Mosquitto in production, amqtt in zero-setup mode.
"""

from __future__ import annotations

import gc
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import free_port
from coordinator.broker import EmbeddedBroker
from sfl_core.transport.mqtt_link import MqttLink
from sfl_core.transport.broker_url import BrokerAddress, parse_broker_url

REPO = Path(__file__).resolve().parents[1]
BROKERS = ["mosquitto", "embedded_broker"]


# ---------------------------------------------------------------- URL parsing
@pytest.mark.parametrize("url, expected", [
    ("mqtt://broker.lan", BrokerAddress("broker.lan", 1883)),
    ("mqtt://broker.lan:1884", BrokerAddress("broker.lan", 1884)),
    ("tcp://10.0.0.5:1883", BrokerAddress("10.0.0.5", 1883)),
    ("mqtts://broker.example.org", BrokerAddress("broker.example.org", 8883, tls=True)),
    ("mqtts://h:9999", BrokerAddress("h", 9999, tls=True)),
    ("mqtt://alice:s3cret@h:1883", BrokerAddress("h", 1883, username="alice", password="s3cret")),
    ("mqtt://alice@h", BrokerAddress("h", 1883, username="alice")),
    ("mqtt://al%40ce:p%3Aw@h", BrokerAddress("h", 1883, username="al@ce", password="p:w")),
    ("localhost:1883", BrokerAddress("localhost", 1883)),
    ("  192.168.1.2  ", BrokerAddress("192.168.1.2", 1883)),
    ("mqtt://[::1]:1885", BrokerAddress("::1", 1885)),
])
def test_parse_broker_url_accepts(url: str, expected: BrokerAddress) -> None:
    assert parse_broker_url(url) == expected


@pytest.mark.parametrize("url, fragment", [
    ("", "empty"),
    ("http://h:80", "scheme"),
    ("mqtt://h:notaport", "port"),
    ("mqtt://h:70000", "port"),
    ("mqtt://h:0", "port"),
    ("mqtt://:1883", "host"),
    ("mqtt://h:1883/some/path", "path"),
    ("mqtt://:pw@h", "user"),
])
def test_parse_broker_url_rejects(url: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_broker_url(url)


def test_broker_address_url_hides_password() -> None:
    addr = parse_broker_url("mqtts://bob:hunter2@h:8884")
    assert addr.url() == "mqtts://bob@h:8884"
    assert "hunter2" not in repr(addr)
    assert parse_broker_url(addr.url()).port == 8884
    assert BrokerAddress("::1", 1883).url() == "mqtt://[::1]:1883"


# ---------------------------------------------------------------- helpers
class Inbox:
    """Collects (topic, payload) from an MqttLink callback for assertions."""

    def __init__(self) -> None:
        self.q: queue.Queue[tuple[str, bytes]] = queue.Queue()

    def __call__(self, topic: str, payload: bytes) -> None:
        self.q.put((topic, payload))

    def get(self, timeout: float = 10.0) -> tuple[str, bytes]:
        return self.q.get(timeout=timeout)

    def drain(self, n: int, timeout: float = 10.0) -> list[tuple[str, bytes]]:
        deadline = time.monotonic() + timeout
        return [self.q.get(timeout=max(0.01, deadline - time.monotonic())) for _ in range(n)]


def _link(url: str, cid: str, subs=(), on_message=None, **kw) -> MqttLink:
    link = MqttLink(url, cid, on_message or (lambda t, p: None), subscriptions=subs, **kw)
    link.connect(timeout=10)
    return link


@pytest.fixture(params=BROKERS)
def broker(request):
    return request.getfixturevalue(request.param)


# ---------------------------------------------------------------- round trips
def test_round_trip_2mib_payload(broker) -> None:
    inbox = Inbox()
    sub = _link(broker.url, "sub", ["t/big/#"], inbox)
    pub = _link(broker.url, "pub")
    try:
        payload = os.urandom(2 * 2**20)
        assert pub.publish("t/big/x", payload, timeout=20) is True
        topic, got = inbox.get(timeout=20)
        assert topic == "t/big/x"
        assert got == payload
    finally:
        pub.close()
        sub.close()


def test_link_sends_small_packets_at_once(broker) -> None:
    """TCP_NODELAY: without it a PUBACK or a step's message written behind an unacknowledged
    packet waits for the peer's delayed ACK (40 ms), once per training step."""
    link = _link(broker.url, "nodelay")
    try:
        sock = link._client.socket()  # noqa: SLF001 - the option lives on paho's socket
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        link.close()


def test_hundred_small_messages_arrive_in_order(broker) -> None:
    inbox = Inbox()
    sub = _link(broker.url, "sub", ["t/seq"], inbox)
    pub = _link(broker.url, "pub")
    try:
        for i in range(100):
            assert pub.publish("t/seq", i.to_bytes(4, "big"), timeout=10)
        got = [int.from_bytes(p, "big") for _, p in inbox.drain(100, timeout=15)]
        assert got == list(range(100))
        assert inbox.q.empty()
    finally:
        pub.close()
        sub.close()


def test_a_burst_is_acknowledged_together_and_arrives_in_order(broker) -> None:
    """publish_many hands every message to paho before awaiting any acknowledgement: one bool per
    message, in the order given, and the subscriber sees them in that order."""
    inbox = Inbox()
    sub = _link(broker.url, "sub", ["t/burst/#"], inbox)
    pub = _link(broker.url, "pub")
    try:
        burst = [(f"t/burst/{i % 3}", i.to_bytes(4, "big") * 512) for i in range(150)]
        assert pub.publish_many(burst, timeout=20) == [True] * 150
        got = inbox.drain(150, timeout=20)
        assert [p for _, p in got] == [p for _, p in burst] and [t for t, _ in got] == [t for t, _ in burst]
        assert pub.publish_many([], timeout=1) == []
    finally:
        pub.close()
        sub.close()


def test_a_burst_while_the_broker_is_down_is_not_awaited(mosquitto) -> None:
    """wait_offline=False (the coordinator's way): during an outage every message of a burst
    reports False at once instead of holding the caller for the timeout (paho keeps them queued
    for the reconnect), and the link publishes again once the broker is back."""
    pub = _link(mosquitto.url, "pub")
    try:
        mosquitto.stop()
        deadline = time.monotonic() + 5
        while pub.connected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pub.connected
        t0 = time.monotonic()
        assert pub.publish_many([("t/later", b"a"), ("t/later", b"b")], timeout=10, wait_offline=False) == [False] * 2
        assert time.monotonic() - t0 < 5
        mosquitto.start()
        assert pub.wait_connected(15)
        assert pub.publish_many([("t/later", b"c")], timeout=10) == [True]
    finally:
        pub.close()


def test_retained_message_reaches_late_subscriber(broker) -> None:
    pub = _link(broker.url, "pub")
    try:
        assert pub.publish("t/status/a1", b"online", retain=True)
        inbox = Inbox()
        late = _link(broker.url, "late", ["t/status/+"], inbox)
        try:
            assert inbox.get(timeout=10) == ("t/status/a1", b"online")
        finally:
            late.close()
    finally:
        pub.close()


def test_coordinator_repeats_the_run_description_when_agents_come_online(mosquitto) -> None:
    """A broker may hold the retained description on another node (RabbitMQ 3.x): each agent's
    online status makes the coordinator publish the same bytes again, at most once a second,
    and a burst of agents is answered by one repeat after it, not dropped."""
    from coordinator.mqtt_transport import INFO_REPEAT_MIN_S, MqttTransport
    from sfl_core.wire import protocol
    from sfl_core.wire.protocol import Message

    transport = MqttTransport(mosquitto.url, "rep").start()
    inbox = Inbox()
    agent = _link(mosquitto.url, "agent-x", [protocol.info_topic("rep")], inbox)
    try:
        transport.publish_run_info({"model": "m"})
        _, first = inbox.get()                       # the retained (or live) copy
        online = lambda i: Message("status", "rep", f"a{i}", {"online": True, "instance": "i"}, seq=i).encode()
        for i in range(5):                           # five agents come online at once
            agent.publish(protocol.status_topic("rep", f"a{i}"), online(i))
        repeats = [inbox.get(timeout=5)[1]]
        try:
            repeats.append(inbox.get(timeout=3 * INFO_REPEAT_MIN_S)[1])
        except queue.Empty:
            pass
        assert repeats and all(r == first for r in repeats)   # identical bytes: the same seq
        assert len(repeats) <= 2 and inbox.q.empty()
        late = time.monotonic()
        agent.publish(protocol.status_topic("rep", "a9"), online(9))
        assert inbox.get(timeout=5)[1] == first       # a later agent gets its own repeat
        assert time.monotonic() - late < 3
    finally:
        agent.close()
        transport.close()


_WILL_CHILD = """
import sys, time
from sfl_core.transport.mqtt_link import MqttLink
link = MqttLink(sys.argv[1], "dying-agent", lambda t, p: None,
                will=("t/status/dying-agent", b"offline", True), keepalive=5)
link.connect(timeout=10)
assert link.publish("t/status/dying-agent", b"online", retain=True)
print("ready", flush=True)
time.sleep(60)
"""


def test_last_will_sent_when_client_dies_but_not_on_close(broker) -> None:
    inbox = Inbox()
    watcher = _link(broker.url, "watcher", ["t/status/#"], inbox)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen([sys.executable, "-c", _WILL_CHILD, broker.url], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        assert inbox.get(timeout=10) == ("t/status/dying-agent", b"online")
        child.send_signal(signal.SIGKILL)   # no DISCONNECT: the broker must publish the will
        child.wait(timeout=5)
        assert inbox.get(timeout=10) == ("t/status/dying-agent", b"offline")

        # A clean close() sends DISCONNECT, so that will must NOT be published.
        polite = _link(broker.url, "polite", will=("t/status/polite", b"offline", False))
        polite.close()
        polite.close()  # idempotent
        with pytest.raises(queue.Empty):
            inbox.get(timeout=1.0)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        watcher.close()

    # the will was retained: a late subscriber sees the agent as offline
    late_inbox = Inbox()
    late = _link(broker.url, "late", ["t/status/dying-agent"], late_inbox)
    try:
        assert late_inbox.get(timeout=10) == ("t/status/dying-agent", b"offline")
    finally:
        late.close()


def test_handler_exception_does_not_kill_link(embedded_broker) -> None:
    got: list[bytes] = []
    done = threading.Event()

    def handler(topic: str, payload: bytes) -> None:
        if payload == b"boom":
            raise RuntimeError("handler bug")
        got.append(payload)
        done.set()

    sub = _link(embedded_broker.url, "sub", ["t/x"], handler)
    pub = _link(embedded_broker.url, "pub")
    try:
        assert pub.publish("t/x", b"boom")
        assert pub.publish("t/x", b"fine")
        assert done.wait(10)
        assert got == [b"fine"]
        assert sub.connected
    finally:
        pub.close()
        sub.close()


def test_publish_from_callback_thread_does_not_deadlock(embedded_broker) -> None:
    """The coordinator answers requests from inside on_message; that must not block paho."""
    inbox = Inbox()
    holder: dict[str, MqttLink] = {}

    def echo(topic: str, payload: bytes) -> None:
        holder["srv"].publish("t/reply", payload)

    holder["srv"] = _link(embedded_broker.url, "srv", ["t/req"], echo)
    cli = _link(embedded_broker.url, "cli", ["t/reply"], inbox)
    try:
        assert cli.publish("t/req", b"ping")
        assert inbox.get(timeout=10) == ("t/reply", b"ping")
    finally:
        cli.close()
        holder["srv"].close()


def test_clients_connecting_while_others_subscribe_are_all_served(broker, caplog) -> None:
    """Agents start together: some connect while others subscribe, with retained messages
    on the broker. amqtt 0.12.1 walked its subscription table across awaits and dropped a
    connecting client with a traceback when another subscribed meanwhile (a CI failure)."""
    n_clients, n_topics = 30, 30
    errors: list[BaseException] = []
    links: list[MqttLink] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        try:
            link = _link(broker.url, f"burst-{i}")
            with lock:
                links.append(link)
            for t in range(n_topics):
                link.subscribe(f"t/burst/{i}/{t}")
                assert link.publish(f"t/burst/{i}/{t}", b"r" * 64, retain=True, timeout=10)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with caplog.at_level("WARNING"):
        threads = [threading.Thread(target=client, args=(i,)) for i in range(n_clients)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
        try:
            assert not errors, errors[:3]
            assert len(links) == n_clients
            time.sleep(0.3)
            assert all(link.connected for link in links)
            inbox = Inbox()
            late = _link(broker.url, "burst-late", ["t/burst/7/+"], inbox)
            try:
                assert sorted(inbox.drain(n_topics, timeout=15)) == sorted(
                    (f"t/burst/7/{t}", b"r" * 64) for t in range(n_topics))
            finally:
                late.close()
        finally:
            for link in links:
                link.close()
    problems = [r.getMessage() for r in caplog.records
                if "changed size" in r.getMessage() or "lost" in r.getMessage() or r.exc_info]
    assert not problems, problems[:3]


# ---------------------------------------------------------------- failures and reconnects
def test_connect_failure_names_the_broker() -> None:
    port = free_port()
    link = MqttLink(f"mqtt://127.0.0.1:{port}", "nobody", lambda t, p: None)
    with pytest.raises(ConnectionError, match=f"cannot reach MQTT broker at mqtt://127.0.0.1:{port}"):
        link.connect(timeout=2)
    link.close()


def test_reconnect_resubscribes_and_publish_waits_through_outage(mosquitto) -> None:
    inbox = Inbox()
    reconnects: list[float] = []
    sub = _link(mosquitto.url, "sub", ["t/after"], inbox)
    sub.add_reconnect_callback(lambda: reconnects.append(time.monotonic()))
    pub = _link(mosquitto.url, "pub")
    try:
        mosquitto.stop()
        deadline = time.monotonic() + 5
        while (sub.connected or pub.connected) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not sub.connected and not pub.connected

        # publish during the outage: must block (not raise) and succeed after the restart
        result: dict[str, object] = {}

        def outage_publish() -> None:
            t0 = time.monotonic()
            result["ok"] = pub.publish("t/during", b"queued", timeout=20)
            result["took"] = time.monotonic() - t0

        th = threading.Thread(target=outage_publish)
        th.start()
        time.sleep(1.0)
        assert th.is_alive(), "publish returned while the broker was down"
        # and a short timeout during the outage returns False instead of raising
        assert pub.publish("t/during", b"x", timeout=0.3) is False

        mosquitto.start()
        th.join(timeout=20)
        assert result.get("ok") is True
        assert result["took"] >= 1.0

        assert sub.wait_connected(15) and pub.wait_connected(15)
        assert len(reconnects) >= 1
        assert pub.publish("t/after", b"hello again", timeout=10)
        assert inbox.get(timeout=10) == ("t/after", b"hello again")
    finally:
        pub.close()
        sub.close()


# ---------------------------------------------------------------- embedded broker lifecycle
def test_embedded_broker_lifecycle() -> None:
    with EmbeddedBroker() as b:
        assert b.url.startswith("mqtt://127.0.0.1:") and b.port > 0
        with socket.create_connection(("127.0.0.1", b.port), timeout=2):
            pass
        port = b.port
    b.stop()  # idempotent
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_embedded_broker_port_in_use_raises() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        b = EmbeddedBroker(port=port)
        with pytest.raises(RuntimeError, match=str(port)):
            b.start(timeout=5)
        b.stop()


def test_serve_with_its_port_taken_says_one_line(tmp_path) -> None:
    """`sfl-coord serve --listen` on a port another process holds: one line naming the port
    (amqtt's own traceback filtered out), exit 1 (the port may free itself: a restart may work)."""
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "cli.coord", "serve", "--config", str(repo / "profiles" / "runs" /
                            "demo.yaml"), "--listen", f"127.0.0.1:{port}", "--output", str(tmp_path / "out")],
                           cwd=repo, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"embedded MQTT broker failed to start on 127.0.0.1:{port}" in lines[0], p.stderr
    assert "Traceback" not in p.stdout + p.stderr


def test_a_missing_optional_package_is_one_line_naming_its_extra(monkeypatch) -> None:
    from coordinator.broker import BrokerUnavailable
    from sfl_core import extras
    monkeypatch.setitem(sys.modules, "amqtt", None)       # import amqtt raises ImportError
    monkeypatch.delitem(sys.modules, "amqtt.broker", raising=False)
    with pytest.raises(BrokerUnavailable, match=r"the embedded MQTT broker needs the package amqtt .*"
                                                r"pip install 'sfl-edge\[coordinator\]'"):
        extras.import_optional("amqtt.broker", "the embedded MQTT broker", BrokerUnavailable)
    monkeypatch.setattr(extras.sys, "version_info", (3, 9, 2))
    with pytest.raises(BrokerUnavailable, match=r"needs the package amqtt, which needs Python 3.10 or newer "
                                                r"\(this is 3.9\)"):
        extras.import_optional("amqtt.broker", "the embedded MQTT broker", BrokerUnavailable)



def test_embedded_broker_holds_each_connections_task_until_it_returns() -> None:
    """asyncio keeps tasks only weakly, and its protocol drops a connection's task when the
    socket closes; the tasks amqtt left waiting then were destroyed mid-await by the garbage
    collector ("Task was destroyed but it is pending!", a CI failure of the burst test above,
    where a live client's connection went with them). The broker holds each connection's task
    from its first byte until it returns."""
    with EmbeddedBroker() as b:
        held = b._broker.connection_tasks
        links = [_link(b.url, f"held-{i}") for i in range(3)]
        try:
            assert len(held) == 3 and all(not t.done() for t in held)
        finally:
            for link in links:
                link.close()
        deadline = time.monotonic() + 15
        while held and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not held, "a connection's task never returned"


def _half_closed_on(port: int) -> int:
    """How many TCP sockets on this machine wait in CLOSE-WAIT on local ``port``: the peer has
    gone and the owner has not closed its side (Linux's /proc/net/tcp)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            count += int(local.rsplit(":", 1)[1], 16) == port and state == "08"
    return count


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's socket table")
def test_a_connection_that_ends_before_connect_is_closed_by_the_broker_at_once() -> None:
    """amqtt dropped such a connection (a readiness probe, a health check, a port scan) without
    closing it; the garbage collector closed it later, on another thread, socket first and
    stream after, and the stream's close took the descriptor's number, by then a new agent's,
    out of the broker's selector: that agent was never read (a CI failure of the burst test
    above). With the collector off, nothing but the broker can close them here."""
    gc.disable()
    try:
        with EmbeddedBroker() as b:   # start() itself probes the port once
            for _ in range(3):
                with socket.create_connection((b.host, b.port)):
                    pass
            deadline = time.monotonic() + 10
            while _half_closed_on(b.port) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _half_closed_on(b.port) == 0, "the broker left a connection that ended before CONNECT open"
            served = _link(b.url, "after-probes")
            try:
                assert served.publish("t/after", b"x", timeout=10)
            finally:
                served.close()
    finally:
        gc.enable()


def test_a_connection_is_closed_on_its_loop_and_left_alone_without_one() -> None:
    """The broker closes a connection on its loop's thread (where the close also unregisters it);
    a connection task destroyed after its loop has gone does nothing from whatever thread the
    garbage collector runs on."""
    import asyncio

    from coordinator.broker import _close_on_its_loop

    loop = asyncio.new_event_loop()
    try:
        server = loop.run_until_complete(asyncio.start_server(lambda r, w: None, "127.0.0.1", 0))
        port = server.sockets[0].getsockname()[1]
        _, writer = loop.run_until_complete(asyncio.open_connection("127.0.0.1", port))
        _close_on_its_loop(writer)                 # no running loop here: left alone
        assert not writer.is_closing()

        async def on_the_loop() -> None:
            _close_on_its_loop(writer)
            _close_on_its_loop(writer)             # closed once: the second call does nothing

        loop.run_until_complete(on_the_loop())
        assert writer.is_closing()
        server.close()
        loop.run_until_complete(server.wait_closed())
    finally:
        loop.close()


def test_the_broker_loops_unhandled_errors_are_one_line_naming_the_coroutine(caplog) -> None:
    import asyncio

    from coordinator.broker import _log_loop_exception

    async def stream_connected() -> None:
        await asyncio.sleep(0)

    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(stream_connected())
        with caplog.at_level("WARNING"):
            _log_loop_exception(loop, {"message": "Task was destroyed but it is pending!", "task": task})
            _log_loop_exception(loop, {"message": "Task exception was never retrieved",
                                       "exception": TimeoutError("Timeout waiting for PUBACK for packet ID 3")})
        loop.run_until_complete(task)
    finally:
        loop.close()
    assert [r.getMessage() for r in caplog.records] == [
        "embedded MQTT broker: Task was destroyed but it is pending! in "
        "test_the_broker_loops_unhandled_errors_are_one_line_naming_the_coroutine.<locals>.stream_connected "
        "(the client concerned reconnects)"]


def test_closing_a_link_whose_network_thread_ends_first_does_not_raise(mosquitto):
    """After the DISCONNECT, paho's thread may end on its own and clear the client's handle to it
    while loop_stop, which reads that handle again after checking it, is on its way to joining it.
    A coordinator closing a finished run crashed there (exit 1). Here the handle is read, the
    thread ends, and only then does loop_stop join: the same order, every time."""
    link = MqttLink(mosquitto.url, "close-race", lambda topic, data: None)
    link.connect()
    client = link._client
    real = client._thread

    class EndsFirst:
        """paho's handle to its thread, which lets the thread end before loop_stop joins it."""

        def __ne__(self, other: object) -> bool:
            real.join(10)                       # the DISCONNECT ends the loop; the thread clears the handle
            return True

        def __getattr__(self, name: str):
            return getattr(real, name)

    client._thread = EndsFirst()
    link.close()
    assert not real.is_alive() and client._thread is None
