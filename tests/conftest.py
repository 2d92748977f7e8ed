"""Shared pytest fixtures: real MQTT brokers on free local ports.

Tests talk to real brokers (Mosquitto as in production, amqtt as in the
zero-setup mode) rather than mocks, because the bugs that matter — lost
subscriptions after reconnect, wills, large payloads — live in the wire
behaviour, not in our code's call graph.
"""

from __future__ import annotations

import importlib.util
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


def _load_brokers():
    """bench/brokers.py holds the one throw-away-Mosquitto implementation (benches use it too)."""
    spec = importlib.util.spec_from_file_location("sfl_bench_brokers", Path(_REPO) / "bench" / "brokers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_brokers = _load_brokers()
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


@pytest.fixture
def embedded_broker():
    from coordinator.broker import EmbeddedBroker

    broker = EmbeddedBroker(host="127.0.0.1", port=0).start()
    try:
        yield broker
    finally:
        broker.stop()


_BROKER_FIXTURES = {"mosquitto", "embedded_broker", "bench_broker"}


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
