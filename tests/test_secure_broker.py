"""A secured Mosquitto, configured by ``sfl-coord broker-config``: TLS, per-device users, ACL.

Certificates are made in the test with the ``openssl`` command line (a CA, a broker
certificate for 127.0.0.1, and a second, untrusted CA). The broker is a real Mosquitto
started with the generated configuration; clients are the product's own ``MqttLink`` and
real ``sfl-coord``/``sfl-agent`` processes.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordinator.broker_config import BrokerTls, password_hash, write_broker_config
from sfl_core.transport.mqtt_link import MqttLink, broker_address

from conftest import _brokers, free_port
from helpers import REPO, coordinator_key, finish, logs, metrics, write_config

pytestmark = pytest.mark.timeout(240)

RUN = "sec"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", cwd=d)


def make_cert(d: Path, name: str, ca: str, san: str) -> None:
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", cwd=d)
    (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=d)


@pytest.fixture(scope="module")
def secure_broker(tmp_path_factory):
    """Mosquitto with TLS on a free port, users coordinator/a0/a1/a2, the generated ACL."""
    binary = _brokers.find_mosquitto()
    if binary is None or shutil.which("openssl") is None:
        pytest.skip("needs mosquitto and openssl")
    d = tmp_path_factory.mktemp("pki")
    make_ca(d, "ca")
    make_ca(d, "rogue-ca")
    make_cert(d, "broker", "ca", "IP:127.0.0.1,DNS:localhost")
    port = free_port()
    files = write_broker_config(d / "broker", ["a0", "a1", "a2"], port=port, bind="127.0.0.1",
                                tls=BrokerTls(str(d / "broker.crt"), str(d / "broker.key"), str(d / "ca.crt")),
                                server_workers=2)
    conf = files.conf.read_text()
    if os.geteuid() == 0:  # as root Mosquitto drops to user 'mosquitto', which cannot read pytest's 0700 dirs
        conf += "user root\n"
    broker = _brokers.MosquittoBroker(binary, port=port, config=conf)
    broker.start()
    try:
        yield {"port": port, "pki": d, "files": files, "broker": broker}
    finally:
        broker.close()


def link(sb, user: str | None, inbox: "queue.Queue | None" = None, subs=(), *, password_file=None,
         ca: str = "ca.crt", scheme: str = "mqtts") -> MqttLink:
    who = f"{user}@" if user else ""
    if password_file is None and user is not None:
        password_file = str(sb["files"].credentials[user])
    address = broker_address(f"{scheme}://{who}127.0.0.1:{sb['port']}",
                             ca_file=str(sb["pki"] / ca) if scheme == "mqtts" else None,
                             password_file=password_file)
    q = inbox if inbox is not None else queue.Queue()
    return MqttLink(address, f"test-{user}-{time.monotonic_ns()}", lambda t, p: q.put((t, p)), subscriptions=subs)


def drain(q: "queue.Queue", seconds: float) -> list[tuple[str, bytes]]:
    out, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            out.append(q.get(timeout=0.1))
        except queue.Empty:
            pass
    return out


def test_password_hash_format_matches_mosquitto():
    h = password_hash("secret", salt=b"0123456789ab")
    kind, iterations, salt, digest = h.split("$")[1:]
    assert (kind, iterations) == ("7", "101") and len(digest) == 88  # 64-byte SHA-512, base64


def test_agent_reads_only_its_own_topics(secure_broker):
    """a1 subscribes to a0's downward topic and to everything: it gets only its own messages."""
    got_a0, got_a1 = queue.Queue(), queue.Queue()
    coord = link(secure_broker, "coordinator")
    a0 = link(secure_broker, "a0", got_a0, [f"sfl/{RUN}/down/a0", f"sfl/{RUN}/info"])
    a1 = link(secure_broker, "a1", got_a1, [f"sfl/{RUN}/down/a0", "sfl/#", f"sfl/{RUN}/down/a1"])
    for lk in (coord, a0, a1):
        lk.connect(10)
    try:
        assert coord.publish(f"sfl/{RUN}/down/a0", b"gradients for a0")
        assert coord.publish(f"sfl/{RUN}/down/a1", b"weights for a1")
        assert coord.publish(f"sfl/{RUN}/info", b"run description")
        a0_msgs = drain(got_a0, 1.5)
        a1_msgs = drain(got_a1, 0.5)
        assert sorted(t for t, _ in a0_msgs) == [f"sfl/{RUN}/down/a0", f"sfl/{RUN}/info"]
        # a1 asked for a0's topic and for sfl/#: it still sees only its own topic and the broadcast
        assert sorted(t for t, _ in a1_msgs) == [f"sfl/{RUN}/down/a1", f"sfl/{RUN}/info"], a1_msgs
    finally:
        for lk in (coord, a0, a1):
            lk.close()


def test_agent_cannot_publish_as_another_agent(secure_broker):
    got = queue.Queue()
    coord = link(secure_broker, "coordinator", got, [f"sfl/{RUN}/up/+", f"sfl/{RUN}/status/+"])
    a1 = link(secure_broker, "a1")
    coord.connect(10)
    a1.connect(10)
    try:
        a1.publish(f"sfl/{RUN}/up/a0", b"forged activations")      # the broker drops these ...
        a1.publish(f"sfl/{RUN}/status/a0", b"forged status")
        a1.publish(f"sfl/{RUN}/down/a0", b"forged gradients")
        a1.publish(f"sfl/{RUN}/up/a1", b"own activations")         # ... and delivers this one
        msgs = drain(got, 1.5)
        assert msgs == [(f"sfl/{RUN}/up/a1", b"own activations")], msgs
    finally:
        coord.close()
        a1.close()


def test_unauthenticated_and_untrusted_clients_are_refused(secure_broker, tmp_path, caplog):
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not-the-password\n")
    real_password = secure_broker["files"].credentials["a0"].read_text().strip()
    caplog.set_level(logging.DEBUG)
    cases = {
        "anonymous": link(secure_broker, None),
        "wrong password": link(secure_broker, "a0", password_file=str(wrong)),
        "untrusted broker CA": link(secure_broker, "a0", ca="rogue-ca.crt"),
        "plain TCP to the TLS port": link(secure_broker, "a0", scheme="mqtt"),
    }
    for what, lk in cases.items():
        with pytest.raises(ConnectionError) as err:
            lk.connect(5)
        lk.close()
        assert "cannot reach MQTT broker" in str(err.value), what
        assert real_password not in str(err.value)
    assert real_password not in caplog.text


def test_tls_files_need_mqtts(tmp_path):
    ca = tmp_path / "ca.crt"
    ca.write_text("x")
    with pytest.raises(ValueError, match="mqtts://"):
        broker_address("mqtt://a0@host:1883", ca_file=str(ca))
    with pytest.raises(ValueError, match="not found"):
        broker_address("mqtts://a0@host", ca_file=str(tmp_path / "missing.crt"))
    with pytest.raises(ValueError, match="both"):
        broker_address("mqtts://a0@host", cert_file=str(ca))


def test_run_over_tls_with_per_device_credentials(secure_broker, tmp_path):
    """Coordinator and two agents, each with its own user and password file, over mqtts://. The
    coordinator runs two server workers: the second logs in as coordinator-w1 (the user that
    broker-config --server-workers 2 made, with the coordinator's password) and trains a1's rows."""
    sb = secure_broker
    url = f"mqtts://{{user}}@127.0.0.1:{sb['port']}"
    ca = str(sb["pki"] / "ca.crt")
    config = write_config(tmp_path, RUN, rounds=1, local_iters=4,
                          fleet=[{"profile": "s2fl-high-high", "count": 2}])
    cred = sb["files"].credentials
    clog = open(tmp_path / "coord.log", "w")
    coord = subprocess.Popen([sys.executable, "-m", "cli.coord", "serve", "--config", str(config), "--quiet",
                              "--verbose", "--broker", url.format(user="coordinator"), "--ca-file", ca,
                              "--password-file", str(cred["coordinator"]), "--server-workers", "2"],
                             stdout=clog, stderr=subprocess.STDOUT, cwd=REPO)
    agents = []
    for i, user in enumerate(["a0", "a1"]):
        alog = open(tmp_path / f"agent-{i}.log", "w")
        # no --agent-id: the agent takes its broker user name, which the ACL keys on
        agents.append(subprocess.Popen(
            [sys.executable, "-m", "cli.agent", "start", "--profile", "s2fl-high-high", "--broker",
             url.format(user=user), "--ca-file", ca, "--password-file", str(cred[user]), "--run", RUN,
             "--index", str(i), "--verbose", "--coordinator-key", coordinator_key(tmp_path / "out")], stdout=alog, stderr=subprocess.STDOUT, cwd=REPO))
    assert finish([coord, *agents], timeout=180) == [0, 0, 0], logs(tmp_path)
    m = metrics(tmp_path)
    assert m[-1]["round"] == 1 and m[-1]["completed"] == ["a0", "a1"], m[-1]
    assert m[-1]["rejected"] == {}
    assert "server worker 1: round 1 trained a1" in (tmp_path / "coord.log").read_text(), logs(tmp_path)
    text = logs(tmp_path) + (tmp_path / "out" / "metrics.jsonl").read_text()
    for user, path in cred.items():
        assert path.read_text().strip() not in text, f"{user}'s password leaked into logs or metrics"


def test_broker_config_cli_is_idempotent(tmp_path):
    """Running it again (e.g. to add a device) keeps every existing password: deployed boards keep working."""
    out = tmp_path / "broker"
    cmd = [sys.executable, "-m", "cli.coord", "broker-config", str(out), "-a", "dev1"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)
    first = (out / "credentials" / "dev1.password").read_text()
    key = (out / "credentials" / "coordinator.pub").read_text()     # what every device follows
    assert (out / "credentials" / "dev1.password").stat().st_mode & 0o077 == 0
    assert (out / "coordinator.key").stat().st_mode & 0o077 == 0
    subprocess.run([*cmd, "-a", "dev2"], check=True, capture_output=True, cwd=REPO)
    assert (out / "credentials" / "dev1.password").read_text() == first
    assert (out / "credentials" / "coordinator.pub").read_text() == key   # the same coordinator key
    assert {p.name for p in (out / "credentials").iterdir()} == {"coordinator.password", "dev1.password",
                                                                 "dev2.password", "coordinator.pub"}
    conf = (out / "mosquitto.conf").read_text()
    assert "listener 1883" in conf and "set_tcp_nodelay true" in conf  # the secure_broker fixture runs with it
    assert [ln.split(":")[0] for ln in (out / "passwd").read_text().splitlines()] == ["coordinator", "dev1", "dev2"]
    bad = subprocess.run([*cmd, "-a", "no/slash"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "letters, digits" in bad.stderr


def test_client_certificates_instead_of_passwords(secure_broker, tmp_path):
    """--client-certs: the certificate's common name is the user name, so the same ACL applies;
    a client without a certificate signed by the CA is refused."""
    d = secure_broker["pki"]
    make_cert(d, "a0", "ca", "DNS:a0")                 # CN=a0: this device's identity
    make_cert(d, "coordinator", "ca", "DNS:coordinator")
    port = free_port()
    files = write_broker_config(tmp_path / "broker", ["a0"], port=port, bind="127.0.0.1",
                                tls=BrokerTls(str(d / "broker.crt"), str(d / "broker.key"), str(d / "ca.crt"),
                                              client_certs=True))
    assert files.passwd is None and files.credentials == {}
    conf = files.conf.read_text() + ("user root\n" if os.geteuid() == 0 else "")
    broker = _brokers.MosquittoBroker(_brokers.find_mosquitto(), port=port, config=conf).start()
    try:
        def cert_link(name: str | None, inbox=None, subs=()):
            files_kw = {"cert_file": str(d / f"{name}.crt"), "key_file": str(d / f"{name}.key")} if name else {}
            address = broker_address(f"mqtts://127.0.0.1:{port}", ca_file=str(d / "ca.crt"), **files_kw)
            q = inbox if inbox is not None else queue.Queue()
            return MqttLink(address, f"cert-{name}-{time.monotonic_ns()}", lambda t, p: q.put((t, p)),
                            subscriptions=subs)

        got = queue.Queue()
        coord = cert_link("coordinator", got, [f"sfl/{RUN}/up/+"])
        a0 = cert_link("a0")
        coord.connect(10)
        a0.connect(10)
        try:
            a0.publish(f"sfl/{RUN}/up/a1", b"as another agent")     # dropped by the ACL
            a0.publish(f"sfl/{RUN}/up/a0", b"own")
            assert drain(got, 1.5) == [(f"sfl/{RUN}/up/a0", b"own")]
        finally:
            coord.close()
            a0.close()
        anonymous = cert_link(None)
        with pytest.raises(ConnectionError):
            anonymous.connect(5)
        anonymous.close()
    finally:
        broker.close()


def test_server_worker_users_have_the_coordinators_password_and_rights(tmp_path):
    """broker-config --server-workers 3: users coordinator-w1, -w2 read and write every run's topics
    and log in with the coordinator's password; a server worker's transport uses its own user."""
    import base64

    from coordinator.mqtt_transport import _worker_address

    files = write_broker_config(tmp_path, ["a0"], server_workers=3)
    acl = files.acl.read_text()
    for user in ("coordinator", "coordinator-w1", "coordinator-w2"):
        assert f"user {user}\ntopic readwrite sfl/#" in acl
    password = files.credentials["coordinator"].read_text().strip()
    entries = dict(line.split(":", 1) for line in files.passwd.read_text().splitlines())
    assert sorted(entries) == ["a0", "coordinator", "coordinator-w1", "coordinator-w2"]
    assert sorted(files.credentials) == ["a0", "coordinator"]      # one password file for every rank
    for user in ("coordinator-w1", "coordinator-w2"):
        _, _, iterations, salt, _ = entries[user].split("$")
        assert entries[user] == password_hash(password, base64.b64decode(salt), int(iterations))
    assert _worker_address("mqtts://coordinator@127.0.0.1:8883", 2).username == "coordinator-w2"
    assert _worker_address("mqtt://127.0.0.1:1883", 1).username is None
