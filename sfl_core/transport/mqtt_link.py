"""The one paho-mqtt wrapper that both the agent and the coordinator use.

Why a wrapper: paho's defaults are wrong for this product in small ways that
cost a training run — the first connect does not retry with a clear message,
subscriptions vanish after a reconnect with a clean session, a QoS-1 publish
returns before the broker has the bytes (so transfer timings would be
meaningless), and an exception in a message callback can kill paho's network
thread. ``MqttLink`` fixes exactly those things and nothing more.

Threading: paho runs its network loop on its own thread (``loop_start``).
``on_message`` and the reconnect callbacks run on that thread. ``publish`` called
*from* that thread cannot wait for its PUBACK (the thread that would receive it
is the one waiting), so there it only enqueues and returns True.

Keep ``on_message`` short: paho sends the PUBACK, answers keep-alive pings and
reads further messages only after it returns. A handler that trains or runs a
server forward/backward should put the message on a queue for a worker thread;
otherwise the broker may drop the connection (no PINGREQ within 1.5 × keepalive)
and amqtt stops waiting for the PUBACK after 5 s.
"""

from __future__ import annotations

from typing import Optional

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode

from sfl_core.transport.broker_url import BrokerAddress, TlsFiles, parse_broker_url, secure

__all__ = ["MqttLink", "broker_address"]

log = logging.getLogger(__name__)

_SUB_QOS = 1


def broker_address(url: str | BrokerAddress, *, ca_file: str | None = None, cert_file: str | None = None,
                   key_file: str | None = None, password_file: str | None = None) -> BrokerAddress:
    """The broker to connect to, from a URL plus the files a secured deployment needs.

    Why a password file: a password inside ``--broker mqtts://user:pass@...`` is visible to
    every local user in ``ps``; a file readable only by the service is not. The file's first
    line is the password. ValueError names the missing or unreadable file.
    """
    address = url if isinstance(url, BrokerAddress) else parse_broker_url(url)
    for what, path in (("CA", ca_file), ("certificate", cert_file), ("key", key_file)):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"TLS {what} file not found: {path}")
    password = None
    if password_file is not None:
        try:
            lines = Path(password_file).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ValueError(f"cannot read the password file {password_file}: {exc.strerror}") from None
        if not lines or not lines[0]:
            raise ValueError(f"password file {password_file} is empty")
        password = lines[0]
    return secure(address, tls_files=TlsFiles(ca_file, cert_file, key_file), password=password)


def _no_delay(client: mqtt.Client, userdata: object, sock: object) -> None:
    """Send small packets at once (TCP_NODELAY). With Nagle's algorithm a PUBLISH or PUBACK
    written while an earlier packet is unacknowledged waits for the peer's delayed ACK (40 ms on
    Linux): one such wait per training step multiplies a round's time (bench/coordinator_load.py)."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # type: ignore[attr-defined]
    except (AttributeError, OSError):  # not a TCP socket (e.g. a unix socket): nothing to tune
        pass


class MqttLink:
    """Thin paho-mqtt 2.x (CallbackAPIVersion.VERSION2) client: connect, auto-reconnect with
    backoff, re-subscribe on every (re)connect, QoS-1 publish that waits for PUBACK."""

    def __init__(self, url: str | BrokerAddress, client_id: str, on_message: Callable[[str, bytes], None],
                 subscriptions: Sequence[str] = (),
                 will: tuple[str, bytes, bool] | None = None,
                 keepalive: float = 15, clean_start: bool = True) -> None:
        self.address: BrokerAddress = url if isinstance(url, BrokerAddress) else parse_broker_url(url)
        if not client_id:
            raise ValueError("MqttLink needs a non-empty client_id (brokers use it to tell clients apart)")
        self.client_id = client_id
        self._on_message_cb = on_message
        self._subscriptions: list[str] = list(dict.fromkeys(subscriptions))
        self._keepalive = max(1, int(round(keepalive)))
        self._reconnect_cbs: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()          # connected AND subscriptions acknowledged
        self._sub_lock = threading.Lock()
        self._sub_acks: dict[int, threading.Event] = {}   # subscribe(timeout=...) waiting for its SUBACK
        self._conn_result = threading.Event()    # any CONNACK (success or failure) seen
        self._conn_error: str | None = None
        self._pending_sub_mid: int | None = None
        self._pending_reconnect = False
        self._ever_connected = False
        self._closed = False
        self._loop_running = False
        self._paho_thread_id: int | None = None
        self._down_since: float | None = time.monotonic()   # not connected yet
        self._down_total = 0.0
        self.outages = 0
        """Times the connection was lost after it was up (what was in flight then may be gone)."""

        c = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=client_id,
                        clean_session=clean_start, protocol=mqtt.MQTTv311)
        c.reconnect_delay_set(min_delay=0.2, max_delay=5)  # type: ignore[arg-type]  # paho accepts floats
        c.max_inflight_messages_set(100)
        c.max_queued_messages_set(0)                      # 0 = unlimited
        if self.address.username:
            c.username_pw_set(self.address.username, self.address.password)
        if self.address.tls:
            f = self.address.tls_files
            try:  # verifies the broker's certificate and host name; CA None = system trust store
                c.tls_set(ca_certs=f.ca_file, certfile=f.cert_file, keyfile=f.key_file)
            except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
                raise ValueError(f"cannot set up TLS for {self.address.url()}: {exc}") from None
        if will is not None:
            w_topic, w_payload, w_retain = will
            c.will_set(w_topic, bytes(w_payload), qos=1, retain=bool(w_retain))
        c.on_connect = self._handle_connect
        c.on_socket_open = _no_delay
        c.on_disconnect = self._handle_disconnect
        c.on_subscribe = self._handle_subscribe
        c.on_message = self._handle_message
        self._client = c

    # -- public API ---------------------------------------------------------
    @property
    def url(self) -> str:
        return self.address.url()

    @property
    def connected(self) -> bool:
        return self._client.is_connected()

    def connect(self, timeout: float = 10.0) -> None:
        """Connect, start paho's loop thread, and wait until subscriptions are acknowledged.

        Raises ConnectionError("cannot reach MQTT broker at <url>: <reason>") on failure;
        after that the link is stopped and ``connect`` may be called again.
        """
        if self._closed:
            raise RuntimeError("MqttLink is closed")
        deadline = time.monotonic() + timeout
        self._conn_error = None
        self._conn_result.clear()
        self._client.connect_timeout = max(0.5, timeout)
        try:
            self._client.connect(self.address.host, self.address.port, keepalive=self._keepalive)
        except (OSError, ValueError) as exc:  # refused, DNS, TLS handshake, timeout
            self._client.disconnect()   # back to "closed": paho refuses a new timeout while it thinks it connects
            raise ConnectionError(f"cannot reach MQTT broker at {self.url}: {exc}") from exc
        self._client.loop_start()
        self._loop_running = True
        remaining = max(0.0, deadline - time.monotonic())
        if not self._conn_result.wait(remaining) or self._conn_error is not None:
            reason = self._conn_error or f"no CONNACK within {timeout:.1f} s"
            self._stop_loop()
            raise ConnectionError(f"cannot reach MQTT broker at {self.url}: {reason}")
        remaining = max(0.0, deadline - time.monotonic())
        if not self._ready.wait(remaining):
            self._stop_loop()
            raise ConnectionError(
                f"cannot reach MQTT broker at {self.url}: subscriptions not acknowledged within {timeout:.1f} s")

    def live_time(self) -> float:
        """A monotonic clock that stands still while the link is down (and before the first
        connect): time on it is time in which peers could have reached us. Silence measured on
        it does not grow during a broker outage."""
        with self._lock:
            down = self._down_total + (time.monotonic() - self._down_since if self._down_since is not None else 0.0)
        return time.monotonic() - down

    def wait_connected(self, timeout: float) -> bool:
        """True once connected and (re)subscribed; False if that does not happen within ``timeout``."""
        return self._ready.wait(timeout)

    def subscribe(self, topic: str, timeout: float | None = None) -> None:
        """Add a subscription that is kept across reconnects (QoS 1). With ``timeout``, wait (that
        long at most) for the broker's acknowledgement: messages published after it arrive."""
        with self._lock:
            if topic in self._subscriptions:
                return
            self._subscriptions.append(topic)
        if self.connected:
            acked = threading.Event()
            with self._sub_lock:   # the acknowledgement's callback waits until acked is filed
                rc, mid = self._client.subscribe(topic, qos=_SUB_QOS)
                if timeout is not None and rc == MQTTErrorCode.MQTT_ERR_SUCCESS and mid is not None:
                    self._sub_acks[mid] = acked
            if timeout is not None and not acked.wait(timeout):
                log.warning("MQTT subscription to %s not acknowledged within %.0f s", topic, timeout)

    def unsubscribe(self, topic: str) -> None:
        """Drop a subscription added with :meth:`subscribe` (not kept across reconnects any more)."""
        with self._lock:
            if topic not in self._subscriptions:
                return
            self._subscriptions.remove(topic)
        if self.connected:
            self._client.unsubscribe(topic)

    def add_reconnect_callback(self, fn: Callable[[], None]) -> None:
        """``fn()`` runs on paho's thread after every successful reconnect (not the first
        connect), once the re-subscriptions are acknowledged. Use it to re-announce state."""
        self._reconnect_cbs.append(fn)

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                timeout: float | None = 30.0, wait_offline: bool = True) -> bool:
        """Publish and, for QoS ≥ 1, wait until the broker acknowledged it.

        While disconnected the message stays queued in paho and is sent after the
        reconnect; this call waits for that, up to ``timeout`` (None = forever), or, with
        ``wait_offline=False``, returns False at once (a loop that must keep running
        through a broker outage). Returns False on timeout — the message may still be
        delivered later (QoS 1 is at-least-once, so receivers must tolerate duplicates
        anyway). Never raises on a transient drop.
        """
        return self.publish_many([(topic, payload)], qos, retain, timeout, wait_offline)[0]

    def publish_many(self, messages: list[tuple[str, bytes]], qos: int = 1, retain: bool | Sequence[bool] = False,
                     timeout: float | None = 30.0, wait_offline: bool = True) -> list[bool]:
        """:meth:`publish` for several messages, acknowledged together: all are handed to paho
        first and the acknowledgements awaited after, so a round's gradients go out in one
        burst instead of one broker round trip each (``timeout`` covers them all). ``retain``:
        for all, or one per message. One bool per message, in order."""
        if self._closed:
            raise RuntimeError("MqttLink is closed")
        retains = [retain] * len(messages) if isinstance(retain, bool) else list(retain)
        infos: list[mqtt.MQTTMessageInfo | None] = []
        for (topic, payload), keep in zip(messages, retains):
            if isinstance(payload, memoryview):
                payload = payload.tobytes()
            info: Optional[mqtt.MQTTMessageInfo] = self._client.publish(topic, payload, qos=qos, retain=keep)
            assert info is not None
            if info.rc == MQTTErrorCode.MQTT_ERR_QUEUE_SIZE:  # cannot happen with an unlimited queue
                log.error("MQTT publish to %s refused: outgoing queue full", topic)
                info = None
            elif info.rc not in (MQTTErrorCode.MQTT_ERR_SUCCESS, MQTTErrorCode.MQTT_ERR_NO_CONN):
                log.warning("MQTT publish to %s failed: %s", topic, mqtt.error_string(info.rc))
                info = None
            infos.append(info)
        if threading.get_ident() == self._paho_thread_id or qos == 0:
            # on paho's thread, waiting would block the thread that receives the PUBACK
            return [info is not None for info in infos]
        deadline = None if timeout is None else time.monotonic() + timeout
        done = [False] * len(messages)
        # Last first: a broker acknowledges QoS 1 messages in the order it received them (MQTT
        # 3.1.1, 4.6), so once the last is acknowledged the others are too and this thread
        # wakes once per burst, not once per message.
        for i in reversed(range(len(messages))):
            sent = infos[i]
            if sent is None:
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done[i] = self._wait_published(sent, left, wait_offline)
            if not done[i] and (wait_offline or self._ready.is_set()):   # else: queued; sent after the reconnect
                topic, payload = messages[i]
                log.warning("MQTT publish to %s (%d bytes) not acknowledged within %.1f s (connected=%s)",
                            topic, len(payload), timeout or 0.0, self.connected)
        return done

    def close(self) -> None:
        """Disconnect cleanly (DISCONNECT sent, so the broker does NOT publish the will) and
        stop the loop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._ready.clear()
        self._stop_loop()

    def __enter__(self) -> "MqttLink":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------
    def _stop_loop(self) -> None:
        try:
            self._client.disconnect()
        except Exception as exc:  # noqa: BLE001 - best effort
            log.debug("MQTT disconnect: %s", exc)
        if self._loop_running:
            try:
                self._client.loop_stop()
            except AttributeError:
                # paho 2.x: after the disconnect its thread ends on its own and clears the client's
                # handle to it as it goes, which loop_stop reads again between its check and its
                # join ('NoneType' has no 'join'); that thread has ended, which is all we wait for
                pass
            self._loop_running = False

    def _wait_published(self, info: mqtt.MQTTMessageInfo, timeout: float | None, wait_offline: bool = True) -> bool:
        # MQTTMessageInfo.wait_for_publish() raises at once when the message was queued
        # while disconnected (rc=NO_CONN) even though paho sends it after reconnecting,
        # so wait on the same condition it uses ourselves.
        deadline = None if timeout is None else time.monotonic() + timeout
        cond = info._condition  # noqa: SLF001 - paho 2.x MQTTMessageInfo internals
        with cond:
            while not info._published:  # noqa: SLF001
                if not wait_offline and not self._ready.is_set():
                    return False
                if deadline is None:
                    cond.wait(1.0)
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                cond.wait(min(left, 1.0))
        return True

    def _note_thread(self) -> None:
        self._paho_thread_id = threading.get_ident()

    def _handle_connect(self, client: mqtt.Client, userdata: object, flags: object,
                        reason_code: object, properties: object) -> None:
        self._note_thread()
        if getattr(reason_code, "is_failure", False):
            self._conn_error = f"broker refused the connection: {reason_code}"
            log.warning("MQTT %s: %s", self.url, self._conn_error)
            self._conn_result.set()
            return
        with self._lock:
            if self._down_since is not None:
                self._down_total += time.monotonic() - self._down_since
                self._down_since = None
        reconnect = self._ever_connected
        self._ever_connected = True
        if reconnect:
            log.info("MQTT reconnected to %s", self.url)
        with self._lock:
            subs = list(self._subscriptions)
        if subs:
            rc, mid = client.subscribe([(t, _SUB_QOS) for t in subs])
            if rc == MQTTErrorCode.MQTT_ERR_SUCCESS:
                self._pending_sub_mid = mid
                self._pending_reconnect = reconnect
            else:
                log.warning("MQTT re-subscribe failed: %s", mqtt.error_string(rc))
        else:
            self._mark_ready(reconnect)
        self._conn_result.set()

    def _handle_subscribe(self, client: mqtt.Client, userdata: object, mid: int,
                          reason_codes: list, properties: object) -> None:
        self._note_thread()
        failed = [str(rc) for rc in reason_codes if getattr(rc, "is_failure", False)]
        if failed:
            log.error("MQTT broker rejected subscription(s): %s", ", ".join(failed))
        with self._sub_lock:
            acked = self._sub_acks.pop(mid, None)
        if acked is not None:
            acked.set()
        if mid == self._pending_sub_mid:
            self._pending_sub_mid = None
            self._mark_ready(self._pending_reconnect)

    def _mark_ready(self, reconnect: bool) -> None:
        self._ready.set()
        if not reconnect:
            return
        for fn in list(self._reconnect_cbs):
            try:
                fn()
            except Exception:  # noqa: BLE001 - never kill paho's thread
                log.exception("MQTT reconnect callback %r failed", fn)

    def _handle_disconnect(self, client: mqtt.Client, userdata: object, flags: object,
                           reason_code: object, properties: object) -> None:
        self._note_thread()
        self._ready.clear()
        with self._lock:
            if self._down_since is None:
                self._down_since = time.monotonic()
                self.outages += 1
        if not self._closed and getattr(reason_code, "is_failure", False):
            log.warning("MQTT connection to %s lost (%s); reconnecting", self.url, reason_code)

    def _handle_message(self, client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        self._note_thread()
        try:
            self._on_message_cb(msg.topic, bytes(msg.payload))
        except Exception:  # noqa: BLE001 - a bad message must not kill paho's thread
            log.exception("MQTT message handler failed for topic %s", msg.topic)
