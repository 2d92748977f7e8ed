"""Data-plane benchmark: activation messages through the product's MQTT code vs raw paho, on Mosquitto.

Command (full run, ~1-2 minutes on 2 CPU cores)::

    /tmp/venv/bin/python bench/data_plane.py            # writes bench/results/data_plane.json
    /tmp/venv/bin/python bench/data_plane.py --quick    # smoke-test size, numbers not meaningful
    /tmp/venv/bin/python bench/data_plane.py --broker mqtt://127.0.0.1:1883   # use a running broker

What is measured (product path), for each payload size:

- agent side: an ``activations`` :class:`~sfl_core.wire.protocol.Message` whose ``x`` is a real
  client-portion output (a batch of real images through ``blocks[:s]`` of a fresh model,
  encoded with :func:`~sfl_core.wire.codec.encode_tensor` at zstd 3) is packed with
  ``Message.encode``, cut with ``wire.split_chunks`` (1 MiB chunks, as the agent does) and
  sent with ``MqttLink.publish`` to ``sfl/<run>/up/<agent>``, one QoS-1 PUBACK wait per
  chunk - exactly ``AgentRunner._publish``.
- coordinator side: :class:`coordinator.mqtt_transport.MqttTransport` reassembles,
  validates (envelope, schema, run id, sender == topic) and queues it; the clock stops
  when the message comes out of ``poll``.

Batch sizes are chosen so the encoded message is about 16 KiB, 256 KiB, 2 MiB and 8 MiB
(the last two are chunked). Tensor encoding (zstd) happens once before timing; its
cost is reported separately (``enc ms`` / ``dec ms``: ``encode_tensor`` on the agent,
``decode_tensor`` as in the engine's ``_batch``) because the raw reference moves bytes that
are already encoded.

Physical reference, same run, same broker, same payload bytes: a raw paho client
publishes the identical encoded message as ONE MQTT message (no chunking, no envelope
validation) with QoS 1 and ``wait_for_publish``; a raw paho subscriber (QoS 1) hands it
through a ``queue.Queue`` to the main thread. Raw and product runs alternate per repeat.

Columns:

- ``msg/s`` and ``MB/s``: throughput with the sender publishing back to back (the next
  message starts when the previous one's last PUBACK arrived, like the agent); MB = 1e6
  bytes of encoded message. Time from the first send to the last message out of the queue.
- ``p50 ms``: per-message latency measured one at a time (send starts -> validated message
  out of ``poll`` / out of the raw queue); median over all repeats (p90 in the JSON).
- ``thr x`` = product msg/s / raw msg/s (1.0 = no overhead); ``lat x`` = product p50 /
  raw p50 (1.0 = no overhead). Ratios are from this one run.

Caveats: sender, receiver and both paho network threads share one Python process and, on
the reference machine, 2 CPU cores with Mosquitto; loopback TCP, so "network" time is
broker + kernel copies only.
"""

from __future__ import annotations

import math
import queue
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (bench helper; also puts the repo root on sys.path)
import paho.mqtt.client as mqtt  # noqa: E402
import torch  # noqa: E402
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402

from brokers import MosquittoBroker  # noqa: E402
from coordinator.mqtt_transport import MqttTransport  # noqa: E402
from sfl_core.transport.mqtt_link import MqttLink  # noqa: E402
from sfl_core.wire import protocol  # noqa: E402
from sfl_core.wire import codec as wire
from sfl_core.transport.broker_url import parse_broker_url  # noqa: E402
from sfl_core.data.builtin import Dataset, load_dataset  # noqa: E402
from sfl_core.model.zoo import build_model  # noqa: E402
from sfl_core.wire.protocol import Message  # noqa: E402

RUN = "bench-dp"
AGENT = "bench-agent"
KiB = 1024
MiB = 1024 * 1024


@dataclass(frozen=True)
class Case:
    """One payload size: a model's split activations at a codec, batch picked to hit ``target``."""

    name: str
    target_bytes: int
    model: str
    split: int
    codec: str
    digits: bool  # small_cnn on digits; otherwise the --data set
    messages: int  # throughput messages per repeat (full run)
    probes: int  # one-at-a-time latency samples per repeat (full run)


CASES = (
    Case("16KiB", 16 * KiB, "small_cnn", 2, "fp16", True, 300, 100),
    Case("256KiB", 256 * KiB, "resnet8", 2, "fp16", False, 120, 50),
    Case("2MiB", 2 * MiB, "resnet8", 2, "fp32", False, 30, 15),
    Case("8MiB", 8 * MiB, "resnet8", 2, "fp32", False, 10, 6),
)


@dataclass
class Payload:
    case: Case
    batch: int
    body: dict[str, Any]
    encoded: bytes  # one full Message.encode(), the raw reference's bytes
    raw_tensor_bytes: int
    encode_ms: float
    decode_ms: float
    x: torch.Tensor


# --------------------------------------------------------------------------- payloads


def _activations(model_name: str, split: int, ds: Dataset, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = build_model(model_name, ds.input_shape, ds.num_classes)
    model.train()
    n = len(ds.y_train)
    idx = torch.arange(batch) % n
    with torch.no_grad():
        return model.client(split)(ds.x_train[idx]), ds.y_train[idx]


def build_payload(case: Case, ds: Dataset, seed: int) -> Payload:
    """Real activations; the batch is scaled from a 32-sample probe to hit the target size."""
    x, _ = _activations(case.model, case.split, ds, 32, seed)
    per_sample = len(wire.encode_tensor(x, case.codec, 3)["data"]) / 32
    batch = max(1, round(case.target_bytes / per_sample))
    x, y = _activations(case.model, case.split, ds, batch, seed)
    t0 = time.perf_counter()
    enc_x = wire.encode_tensor(x, case.codec, 3)
    enc_ms = (time.perf_counter() - t0) * 1e3
    body = {"x": enc_x, "y": wire.encode_tensor(y.to(torch.int64), "fp32", 3), "compute_s": 0.0}
    t0 = time.perf_counter()
    wire.decode_tensor(enc_x, shape=(batch, *x.shape[1:]), dtypes=("float32", "float16"))
    dec_ms = (time.perf_counter() - t0) * 1e3
    # realistic envelope numbers (seq is a nanosecond clock), so the size matches the product's
    encoded = Message("activations", RUN, AGENT, body, round=1, step=1, seq=protocol.Sequencer().next()).encode()
    raw = x.numel() * (2 if case.codec == "fp16" else 4)
    return Payload(case, batch, body, encoded, raw, enc_ms, dec_ms, x)


# --------------------------------------------------------------------------- the two paths


class ProductPath:
    """Agent-side MqttLink + split_chunks, coordinator-side MqttTransport (validation included)."""

    def __init__(self, url: str):
        self.transport = MqttTransport(url, RUN).start()
        self.link = MqttLink(url, f"sfl-{RUN}-{AGENT}", lambda _t, _p: None)
        self.link.connect()
        self.topic = protocol.up_topic(RUN, AGENT)
        self._seq = protocol.Sequencer()
        self._step = 0

    def send(self, body: dict[str, Any]) -> int:
        """Exactly ``AgentRunner._publish``; returns the step number used."""
        self._step += 1
        msg = Message("activations", RUN, AGENT, body, round=1, step=self._step, seq=self._seq.next())
        payload = msg.encode()
        for piece in wire.split_chunks(payload, uuid.uuid4().hex[:12]):
            if not self.link.publish(self.topic, piece, timeout=60):
                raise RuntimeError("product publish not acknowledged within 60 s")
        return self._step

    def receive(self, timeout: float) -> Message:
        msg = self.transport.poll(timeout)
        if msg is None:
            raise RuntimeError(f"product path: no validated message within {timeout:.0f} s "
                               f"({self.transport.rejected} rejected)")
        return msg

    def close(self) -> None:
        self.link.close()
        self.transport.close()


class RawPath:
    """Two plain paho clients: QoS-1 publish + wait_for_publish, QoS-1 subscription -> queue."""

    def __init__(self, url: str):
        addr = parse_broker_url(url)
        self.topic = f"bench/{RUN}/raw"
        self._q: "queue.Queue[bytes]" = queue.Queue()
        subscribed = threading.Event()
        self.sub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bench-raw-sub")
        self.sub.on_message = lambda _c, _u, m: self._q.put(m.payload)
        self.sub.on_subscribe = lambda *_a: subscribed.set()
        self.sub.connect(addr.host, addr.port)
        self.sub.loop_start()
        self.sub.subscribe(self.topic, qos=1)
        if not subscribed.wait(10):
            raise RuntimeError("raw subscriber: no SUBACK within 10 s")
        self.pub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bench-raw-pub")
        self.pub.max_inflight_messages_set(100)  # same settings as MqttLink
        self.pub.connect(addr.host, addr.port)
        self.pub.loop_start()
        deadline = time.monotonic() + 10
        while not self.pub.is_connected():
            if time.monotonic() > deadline:
                raise RuntimeError("raw publisher: not connected within 10 s")
            time.sleep(0.01)
        self.payload = b""

    def send(self, _body: dict[str, Any]) -> int:
        self.pub.publish(self.topic, self.payload, qos=1).wait_for_publish(60)
        return 0

    def receive(self, timeout: float) -> bytes:
        try:
            return self._q.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"raw path: no message within {timeout:.0f} s") from None

    def close(self) -> None:
        for c in (self.pub, self.sub):
            c.disconnect()
            c.loop_stop()


# --------------------------------------------------------------------------- measurement


def _latencies(send: Callable[[], Any], receive: Callable[[float], Any], n: int) -> tuple[list[float], list[float]]:
    """One message at a time: (send start -> out of the queue, send start -> publish returned)."""
    lat, pub = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        send()
        t1 = time.perf_counter()
        receive(60)
        t2 = time.perf_counter()
        lat.append(t2 - t0)
        pub.append(t1 - t0)
    return lat, pub


def _throughput(send: Callable[[], Any], receive: Callable[[float], Any], n: int) -> float:
    """Seconds for ``n`` back-to-back messages: first send -> last one received."""
    errors: list[BaseException] = []

    def sender() -> None:
        try:
            for _ in range(n):
                send()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    t0 = time.perf_counter()
    th = threading.Thread(target=sender, daemon=True)
    th.start()
    for _ in range(n):
        if errors:
            raise RuntimeError(f"sender failed: {errors[0]}")
        receive(120)
    elapsed = time.perf_counter() - t0
    th.join(10)
    return elapsed


def _stats(lat: list[float], pub: list[float], n_msgs: int, seconds: float, nbytes: int) -> dict[str, float]:
    lat_ms = sorted(v * 1e3 for v in lat)
    return {
        "messages": n_msgs,
        "seconds": round(seconds, 4),
        "msgs_per_s": n_msgs / seconds,
        "mb_per_s": n_msgs * nbytes / seconds / 1e6,
        "latency_ms_p50": statistics.median(lat_ms),
        "latency_ms_p90": lat_ms[min(len(lat_ms) - 1, math.ceil(0.9 * len(lat_ms)) - 1)],
        "latency_ms_min": lat_ms[0],
        "publish_ms_p50": statistics.median(v * 1e3 for v in pub),
        "latency_samples": len(lat_ms),
    }


def measure_case(p: Payload, product: ProductPath, raw: RawPath, repeats: int, quick: bool) -> dict[str, Any]:
    n_thr = max(3, p.case.messages // 10) if quick else p.case.messages
    n_lat = max(3, p.case.probes // 10) if quick else p.case.probes
    raw.payload = p.encoded
    acc: dict[str, dict[str, Any]] = {k: {"lat": [], "pub": [], "n": 0, "s": 0.0} for k in ("raw", "product")}

    def prod_recv(timeout: float) -> None:
        msg = product.receive(timeout)
        # the envelope's seq/step are varints, so sizes may differ by a few bytes
        if msg.type != "activations" or abs(msg.wire_bytes - len(p.encoded)) > 32:
            raise RuntimeError(f"product path delivered {msg.type} of {msg.wire_bytes} B, expected "
                               f"activations of {len(p.encoded)} B")

    paths = {"raw": (lambda: raw.send(p.body), raw.receive), "product": (lambda: product.send(p.body), prod_recv)}
    for name, (send, recv) in paths.items():  # warm-up: connections, first-chunk allocations
        for _ in range(2):
            send()
            recv(60)
    for rep in range(repeats):
        order = ("raw", "product") if rep % 2 == 0 else ("product", "raw")
        for name in order:
            send, recv = paths[name]
            lat, pub = _latencies(send, recv, n_lat)
            secs = _throughput(send, recv, n_thr)
            a = acc[name]
            a["lat"] += lat
            a["pub"] += pub
            a["n"] += n_thr
            a["s"] += secs
    res = {k: _stats(a["lat"], a["pub"], a["n"], a["s"], len(p.encoded)) for k, a in acc.items()}
    pr, rw = res["product"], res["raw"]
    return {
        "case": p.case.name, "model": p.case.model, "split": p.case.split, "codec": p.case.codec,
        "batch": p.batch, "activation_shape": list(p.x.shape[1:]), "zstd_level": 3,
        "payload_bytes": len(p.encoded), "raw_tensor_bytes": p.raw_tensor_bytes,
        "chunks": len(wire.split_chunks(p.encoded, "x" * 12)),
        "encode_tensor_ms": round(p.encode_ms, 3), "decode_tensor_ms": round(p.decode_ms, 3),
        "raw": rw, "product": pr,
        "ratio": {"throughput": pr["msgs_per_s"] / rw["msgs_per_s"],
                  "latency_p50": pr["latency_ms_p50"] / rw["latency_ms_p50"]},
    }


# --------------------------------------------------------------------------- main


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = common.base_parser(__doc__)
    p.add_argument("--broker", default=None, help="MQTT URL of a running broker (default: start a Mosquitto)")
    p.add_argument("--repeats", type=int, default=2, help="alternating raw/product repeats per size (default 2)")
    p.add_argument("--cases", nargs="*", default=None, help=f"subset of {[c.name for c in CASES]}")
    args = p.parse_args(argv)
    repeats = 1 if args.quick else max(1, args.repeats)
    cases = [c for c in CASES if args.cases is None or c.name in args.cases]
    if not cases:
        raise SystemExit(f"--cases: none of {args.cases} is one of {[c.name for c in CASES]}")

    digits = load_dataset("digits")
    data = common.load_data(args.data)
    payloads = [build_payload(c, digits if c.digits else data, args.seed) for c in cases]

    broker: Optional[MosquittoBroker] = None
    url = args.broker
    if url is None:
        broker = MosquittoBroker().start()
        url = broker.url
    product = ProductPath(url)
    raw = RawPath(url)
    t_start = time.perf_counter()
    try:
        rows = [measure_case(pl, product, raw, repeats, args.quick) for pl in payloads]
    finally:
        product.close()
        raw.close()
        version = broker.version() if broker else "external broker"
        if broker:
            broker.stop()

    table = [[r["case"], f"{r['model']} s{r['split']} {r['codec']} b{r['batch']}", r["payload_bytes"] / KiB,
              r["chunks"], r["raw"]["msgs_per_s"], r["product"]["msgs_per_s"], r["ratio"]["throughput"],
              r["raw"]["mb_per_s"], r["product"]["mb_per_s"], r["raw"]["latency_ms_p50"],
              r["product"]["latency_ms_p50"], r["ratio"]["latency_p50"], r["encode_tensor_ms"], r["decode_tensor_ms"]]
             for r in rows]
    common.print_table(
        f"data plane over Mosquitto ({version}): product (MqttLink+chunks -> MqttTransport) vs raw paho QoS 1",
        ["size", "tensor", "KiB", "chunks", "raw msg/s", "prod msg/s", "thr x", "raw MB/s", "prod MB/s",
         "raw p50 ms", "prod p50 ms", "lat x", "enc ms", "dec ms"], table,
        caption="thr x = product/raw throughput (1 = no overhead); lat x = product/raw median latency; "
                "enc/dec = encode_tensor/decode_tensor, outside both paths. One process, shared CPU cores.")
    doc = {
        "quick": args.quick, "repeats": repeats, "broker": version, "broker_url": url,
        "data": data.name, "seconds": round(time.perf_counter() - t_start, 2),
        "chunk_bytes": wire.CHUNK_BYTES,
        "note": ("product = Message.encode + wire.split_chunks + MqttLink.publish (PUBACK per chunk) -> "
                 "MqttTransport reassembly + validation -> poll; raw = paho QoS-1 publish+wait_for_publish of "
                 "the same encoded bytes as one message -> paho subscriber -> queue. Sender, receiver and "
                 "Mosquitto share the machine's CPU cores."),
        "cases": rows,
    }
    path = common.write_result(args.out, "data_plane", doc)
    print(f"wrote {path}")
    return doc


if __name__ == "__main__":
    main()
