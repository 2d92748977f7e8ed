"""Embedded MQTT broker: the zero-setup default for ``sfl-coord serve`` without ``--broker``.

Why embedded: a first-time user should be able to run the coordinator and a few
agents on one laptop without installing Mosquitto. For real deployments (many
boards, TLS, auth) point everyone at a Mosquitto broker instead (see
``sfl-coord broker-config``, which writes a configuration with TLS, per-device users
and a topic ACL).

amqtt is asyncio-based; the coordinator is thread-based (paho). So the broker
runs on its own daemon thread with its own event loop, and ``start()`` only
returns once a TCP connect to the listener succeeds, so callers can connect
right away.

amqtt has no maximum packet size of its own (it reads the MQTT "remaining
length" and then ``readexactly``), so multi-MB tensors pass; ``max_message_bytes``
is kept for interface parity with Mosquitto and documented, not enforced.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import threading
import time
from typing import Any

from sfl_core.extras import import_optional

__all__ = ["EmbeddedBroker"]


def __getattr__(name: str) -> Any:
    # amqtt loads plugins by dotted path; resolve this one lazily (see below).
    if name == "CleanDisconnectPlugin":
        return _clean_disconnect_plugin_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

log = logging.getLogger(__name__)

# amqtt logs every connection at INFO and packet dumps at DEBUG; a training
# run makes thousands of these, so keep it at WARNING unless the user opts in.
_NOISY_LOGGERS = ("amqtt", "transitions")


class _DropAmqttNoise(logging.Filter):
    """Drop amqtt log records that look like faults but are not.

    * A TCP connection that closes before sending CONNECT (our readiness probe, a
      health check, a port scan) is logged at ERROR.
    * At shutdown, messages still queued for clients that already left are counted
      ("N messages not broadcasted") at WARNING: nothing a user can act on.
    * When a subscriber acknowledges a QoS-1 message after amqtt's fixed 5 s, amqtt
      logs one WARNING (kept: it tells the user a handler is slow) and then an ERROR
      traceback plus an "unknown PUBACK" warning for the same event (dropped). The
      message itself was delivered; amqtt just stops waiting for its PUBACK.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if ("No data to decode MQTT packet fixed header" in msg
                or "Can't read first packet as CONNECT" in msg
                or "messages not broadcasted" in msg   # at shutdown: to clients already gone; nothing to act on
                or "Received PUBACK for unknown pending message" in msg
                or "Broker instance can't be started" in msg or "Broker startup failed" in msg):   # start() says it in one line
            return False
        if "Task failed and will be skipped" in msg and record.exc_info:
            exc = record.exc_info[1]
            if isinstance(exc, TimeoutError) and "PUBACK" in str(exc):
                return False
        return True


_NOISE_FILTER = _DropAmqttNoise()


def _quiet_amqtt_logging() -> None:
    for name in _NOISY_LOGGERS:
        lg = logging.getLogger(name)
        if lg.level == logging.NOTSET or lg.level < logging.WARNING:
            lg.setLevel(logging.WARNING)
    for name in ("amqtt.broker", "amqtt.mqtt.protocol.handler"):
        lg = logging.getLogger(name)
        if _NOISE_FILTER not in lg.filters:
            lg.addFilter(_NOISE_FILTER)


class BrokerUnavailable(RuntimeError):
    """The embedded broker cannot run here (its package is missing, or needs a newer Python): a
    configuration error; ``--broker URL`` uses another broker."""


class BrokerStartError(RuntimeError):
    """The embedded broker did not start (its port in use, ...)."""


@functools.lru_cache(maxsize=1)
def _clean_disconnect_plugin_class() -> type:
    """Build the amqtt plugin lazily so importing this module never requires amqtt."""
    from amqtt.mqtt.disconnect import DisconnectPacket
    from amqtt.plugins.base import BasePlugin

    class CleanDisconnectPlugin(BasePlugin):  # type: ignore[type-arg]
        """Work around an amqtt 0.12.1 race that publishes the last will on a CLEAN disconnect.

        amqtt handles DISCONNECT in a separate task; when the client closes its socket
        right after sending DISCONNECT (paho does), the reader sees EOF first, cancels
        that task and treats the session as lost, so the will ("agent offline") goes
        out although the agent left politely. This hook sees every packet before the
        reader loop continues and clears the session's will flag on DISCONNECT, which
        is exactly what MQTT 3.1.1 §3.14.4 requires the server to do.
        """

        async def on_mqtt_packet_received(self, *, packet: Any, session: Any = None) -> None:
            if session is not None and isinstance(packet, DisconnectPacket):
                session.will_flag = False

    return CleanDisconnectPlugin


class _SnapshotDict(dict):  # type: ignore[type-arg]
    """A dict whose iteration walks a copy taken when the iteration starts (see below)."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(dict.keys(self)))

    def keys(self):  # type: ignore[no-untyped-def, override]
        return list(dict.keys(self))

    def values(self):  # type: ignore[no-untyped-def, override]
        return list(dict.values(self))

    def items(self):  # type: ignore[no-untyped-def, override]
        return list(dict.items(self))


@functools.lru_cache(maxsize=1)
def _broker_class() -> type:
    """amqtt's Broker with two fixes for agents that start together (amqtt 0.12.1).

    * When a client connects, amqtt walks the broker's table of subscriptions and
      awaits the delivery of retained messages for each entry; when it fans a message
      out it awaits per subscriber while walking the same table. Another client
      subscribing or leaving meanwhile changes the table's size, the walk raises
      ``dictionary changed size during iteration`` and the connecting client is
      dropped. The table now iterates over a copy, which is what the loops mean.
    * That walk on connect is meant to resend retained messages for the *session's own*
      subscriptions, but it covers every client's: a new agent received the retained
      messages of topics it never subscribed to. Retained messages now go only to a
      client subscribed to the filter.

    And two for Python's streams:

    * asyncio keeps only weak references to tasks, and the task serving a connection is
      held by nothing but its protocol object, which lets go of it when the socket closes.
      A connection task still waiting then (on acknowledgements to retained messages, say)
      is garbage; the collector destroys it mid-await ("Task was destroyed but it is
      pending!") and, with it, whatever its frame kept alive. The broker now holds each
      connection's task until it returns, as asyncio's documentation asks.
    * A connection that ends before its CONNECT (a readiness probe, a health check, a port
      scan) is dropped by amqtt without closing it. The garbage collector closed it later,
      on whichever thread it ran: its socket first, so the descriptor's number went to the
      next connection, then its stream, which took that number out of the event loop's
      selector. The agent on the new connection was accepted and never read (no CONNACK,
      or no PUBACK: a CI failure). The broker now closes every connection when its task
      returns, on the loop's thread.
    """
    from amqtt.broker import Broker

    class _Broker(Broker):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._subscriptions = _SnapshotDict(self._subscriptions)  # type: ignore[has-type]
            self.connection_tasks: set[asyncio.Task[Any]] = set()

        async def stream_connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                   listener_name: str) -> None:
            task = asyncio.current_task()
            if task is not None:
                self.connection_tasks.add(task)
            try:
                await super().stream_connected(reader, writer, listener_name)
            finally:
                self.connection_tasks.discard(task)  # type: ignore[arg-type]
                _close_on_its_loop(writer)

        async def _publish_retained_messages_for_subscription(self, subscription: Any, session: Any) -> None:
            subscribers = self._subscriptions.get(subscription[0], ())
            if any(s.client_id == session.client_id for s, _ in subscribers):
                await super()._publish_retained_messages_for_subscription(subscription, session)

    return _Broker


def _close_on_its_loop(writer: asyncio.StreamWriter) -> None:
    """Close a connection's stream unless it is closed already, and only on its loop's thread,
    where closing also takes it out of the loop's selector. (A connection task the garbage
    collector destroys after the loop has closed runs its ``finally`` with no loop: nothing is
    left to unregister then.)"""
    if writer.is_closing():
        return
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    writer.close()


def _log_loop_exception(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """One line, no traceback, for an error amqtt leaves unhandled on the broker's loop.

    A retained message sent to a client that leaves before acknowledging it times out in a
    task whose result amqtt never reads; as with the broadcast's own timeouts (see
    :class:`_DropAmqttNoise`), the message was sent and there is nothing to act on.
    """
    exc = context.get("exception")
    if isinstance(exc, TimeoutError) and "PUBACK" in str(exc):
        return
    what = f"{type(exc).__name__}: {exc}" if exc is not None else context.get("message", "unknown error")
    task = context.get("task") or context.get("future")
    coro = getattr(task, "get_coro", lambda: None)()
    where = f" in {coro.__qualname__}" if coro is not None and hasattr(coro, "__qualname__") else ""
    log.warning("embedded MQTT broker: %s%s (the client concerned reconnects)", what, where)


class EmbeddedBroker:
    """amqtt broker on a background thread with its own asyncio loop."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 max_message_bytes: int = 64 * 2**20) -> None:
        if not (0 <= int(port) <= 65535):
            raise ValueError(f"port must be in 0..65535, got {port}")
        self.host = host
        self._requested_port = int(port)
        self.max_message_bytes = int(max_message_bytes)
        self._port: int | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._broker: Any = None
        self._stop_event: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    # -- public API ---------------------------------------------------------
    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("EmbeddedBroker not started; call start() first")
        return self._port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"mqtt://{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._ready.is_set()

    def start(self, timeout: float = 10.0) -> "EmbeddedBroker":
        """Start the broker; return once it accepts TCP connections.

        Raises :class:`BrokerUnavailable` (amqtt missing or this Python too old for it) or
        :class:`BrokerStartError` (port in use, ...), with the reason.
        """
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("EmbeddedBroker already started")
            # fail early with one line (or pass --broker mqtt://host:1883 to use another broker)
            import_optional("amqtt.broker", "the embedded MQTT broker (no --broker given)", BrokerUnavailable)
            _quiet_amqtt_logging()
            self._ready.clear()
            self._error = None
            self._thread = threading.Thread(target=self._run, name="sfl-embedded-broker", daemon=True)
            self._thread.start()
        deadline = time.monotonic() + timeout
        self._ready.wait(timeout)
        if self._error is not None or not self._ready.is_set():
            reason = (f"{type(self._error).__name__}: {self._error}" if self._error is not None
                      else f"not listening after {timeout:.1f} s")
            self.stop()
            raise BrokerStartError(
                f"embedded MQTT broker failed to start on {self.host}:{self._requested_port}: {reason}")
        # The listener is bound; confirm a real TCP connect works before returning.
        last: OSError | None = None
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((self.host, self.port), timeout=1.0):
                    return self
            except OSError as exc:
                last = exc
                time.sleep(0.05)
        self.stop()
        raise BrokerStartError(
            f"embedded MQTT broker on {self.host}:{self._port} does not accept connections: {last}")

    def stop(self) -> None:
        """Shut the broker down and join its thread. Safe to call repeatedly."""
        with self._lock:
            thread = self._thread
            self._thread = None
        if thread is None:
            return
        # start() may still be in progress on the broker thread; wait until the loop
        # and its stop event exist (or the thread failed) before signalling it.
        self._ready.wait(timeout=15)
        loop, ev = self._loop, self._stop_event
        if loop is not None and ev is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # loop already closed
                pass
        thread.join(timeout=15)
        if thread.is_alive():
            log.warning("embedded MQTT broker thread did not stop within 15 s")
        self._ready.clear()

    def __enter__(self) -> "EmbeddedBroker":
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals ------------------------------------------------------------
    def _config(self) -> dict[str, Any]:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return {
            "listeners": {"default": {"type": "tcp", "bind": f"{host}:{self._requested_port}",
                                      "max_connections": 0}},
            # Only anonymous auth: no $SYS plugin (periodic noise), no topic checking,
            # no event/packet logger plugins (they log per packet).
            "plugins": {
                "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True},
                f"{__name__}.CleanDisconnectPlugin": {},
            },
        }

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        loop.set_exception_handler(_log_loop_exception)
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            if self._error is None:
                self._error = exc
            if self._ready.is_set():
                log.error("embedded MQTT broker crashed: %s", exc)
            self._ready.set()  # wake start() so it reports the error
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            except Exception:  # noqa: BLE001
                pass
            loop.close()

    async def _serve(self) -> None:
        self._stop_event = asyncio.Event()
        broker = _broker_class()(self._config())
        self._broker = broker
        await broker.start()
        try:
            self._port = self._bound_port(broker)
            self._ready.set()
            await self._stop_event.wait()
        finally:
            try:
                await asyncio.wait_for(broker.shutdown(), timeout=10)
            except Exception as exc:  # noqa: BLE001 - shutdown is best effort
                log.debug("embedded broker shutdown: %s", exc)

    def _bound_port(self, broker: Any) -> int:
        """Actual listening port (differs from the requested one when it was 0)."""
        try:
            server = broker._servers["default"].instance  # amqtt keeps no public accessor
            return int(server.sockets[0].getsockname()[1])
        except Exception:  # noqa: BLE001
            if self._requested_port:
                return self._requested_port
            raise RuntimeError("cannot determine the port amqtt bound to")
