"""Shared pytest fixtures: real MQTT brokers on free local ports.

Tests talk to real brokers (Mosquitto as in production, amqtt as in the
zero-setup mode) rather than mocks, because the bugs that matter — lost
subscriptions after reconnect, wills, large payloads — live in the wire
behaviour, not in our code's call graph.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Make the repository importable without `pip install -e .` (a fresh checkout runs its tests).
_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

MOSQUITTO_MISSING = "mosquitto not installed: apt-get install mosquitto"
RABBITMQ_MISSING = "rabbitmq-server not installed: apt-get install rabbitmq-server"


from helpers import bench_module  # noqa: E402  (after the path fix)


@pytest.fixture(autouse=True)
def _collect_as_before() -> Iterator[None]:
    """``sfl-coord serve``, ``simulate`` and ``demo`` freeze the objects they are set up with
    (:mod:`coordinator.garbage_collection`); run in this process by a test, they would freeze the
    test session's too, and its later garbage cycles would never be collected. Each test ends
    with the collector as it was."""
    yield
    gc.unfreeze()


_brokers = bench_module("brokers")   # the one throw-away-Mosquitto implementation (benches use it too)
free_port = _brokers.free_port
wait_port = _brokers.wait_port


@pytest.fixture
def mosquitto() -> Iterator:
    binary = _brokers.find_mosquitto()
    if binary is None:
        if os.environ.get("SFL_REQUIRE_MOSQUITTO") == "1":
            pytest.fail(MOSQUITTO_MISSING)
        pytest.skip(MOSQUITTO_MISSING)
    broker = _brokers.MosquittoBroker(binary)
    broker.start()
    try:
        yield broker
    finally:
        broker.close()


@pytest.fixture(scope="module")
def rabbitmq_cluster() -> Iterator[tuple]:
    """Two RabbitMQ nodes (MQTT plugin) joined in one cluster, each with its own MQTT port.

    Module-scoped: a node takes ~12 s to boot, and the tests of a module can share a cluster
    because every test uses its own run id."""
    import tempfile

    if _brokers.find_rabbitmq() is None:
        if os.environ.get("SFL_REQUIRE_RABBITMQ") == "1":
            pytest.fail(RABBITMQ_MISSING)
        pytest.skip(RABBITMQ_MISSING)
    with tempfile.TemporaryDirectory(prefix="sfl-rabbitmq-cookie-") as home:
        nodes = [_brokers.RabbitMQNode(name, cookie_home=home) for name in ("a", "b")]
        try:
            for node in nodes:
                node.start()
            nodes[1].join(nodes[0])
            yield tuple(nodes)
        finally:
            for node in nodes:
                node.close()


@pytest.fixture
def embedded_broker():
    from coordinator.broker import EmbeddedBroker

    broker = EmbeddedBroker(host="127.0.0.1", port=0).start()
    try:
        yield broker
    finally:
        broker.stop()


_BROKER_FIXTURES = {"mosquitto", "embedded_broker", "bench_broker", "rabbitmq_cluster"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Sort every test into one of three groups, selectable with ``-m``:

    - ``system``: real coordinator/agent processes, installs or wheels (the ``slow`` ones);
    - ``integration``: a real broker in this process (Mosquitto or the embedded one);
    - ``unit``: everything else (pure functions, the engine with in-process agents).
    """
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.system)
        elif _BROKER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
        else:
            item.add_marker(pytest.mark.unit)
